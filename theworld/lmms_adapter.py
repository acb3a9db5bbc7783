"""lmms-eval model adapter: `python -m lmms_eval --model theworld --model_args pretrained=RUN_DIR --tasks ...`.

Installed with the `eval` extra (`pip install .[eval]`); lmms-eval finds the model through the `lmms_eval.models`
entry point in pyproject.toml (`manifest` below). `pretrained` is what `TheWorld.from_pretrained` takes (a final/ or
checkpoint-N/ folder or a run's output_dir); other model_args: `device`, `ema` (true: the EMA weights),
`max_new_tokens` (the default for generate_until, 16). `batch_size` (lmms-eval always passes it) is accepted and
unused: requests run one document at a time. A missing or unreadable model or an unknown model_arg is one line and
exit code 2 (lmms-eval itself would print a traceback and exit 0).

A request's images are the task's `doc_to_visual(doc)`: every image gets its image tokens before the text, in order,
and the world latents come from the first one, as in theworld.evaluate. The text goes into the user turn of the chat
template the model was trained with.
- `loglikelihood`: the summed negative log-probability of the continuation and the model turn's <end_of_turn> after
  the context (minus theworld.evaluate's loglik score). lmms-eval's multiple_choice tasks pick the choice with the
  lowest value (lmms_eval/api/task.py, `np.argmin`; its own models return their loss, lmms-eval issue #370), so this
  sign makes its pick theworld.evaluate's. The requests of one document that share a context share one prefix
  (theworld/infer/prefix_scoring.py). `is_greedy`: every one of those tokens is the most likely one.
- `generate_until`: greedy decoding with the KV cache (theworld/infer/generate.py) up to <end_of_turn>/EOS,
  `max_new_tokens` or the first of the request's `until` strings (cut off there, after leading whitespace is dropped
  as TheWorld.generate drops it: lmms-eval's default `until` is a blank line, which would otherwise cut an answer that
  starts with one to nothing).
"""

from __future__ import annotations

import os
from itertools import groupby
from typing import NoReturn

import torch
from lmms_eval.api.model import lmms

from theworld.core import location, log
from theworld.core.errors import UserError, one_line
from theworld.infer import generate as gen
from theworld.infer import prefix_scoring
from theworld.model import images as imagelib
from theworld.model.inputs import prompt_only

_log = log.get(__name__)

MODEL_ID = "theworld"


def manifest():
    """The `lmms_eval.models` entry point's payload."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=f"{__name__}.TheWorldLMM")


def _as_response(pair: tuple[float, bool]):
    """`pair` in a form lmms-eval's evaluator keeps: some versions (0.7.3) pass every model output through
    `unwrap_generation_output`, which turns a (float, bool) tuple into its string and breaks every multiple_choice
    task; a `GenerationResult` comes through untouched."""
    from lmms_eval.api import instance

    unwrap = getattr(instance, "unwrap_generation_output", None)
    if unwrap is None or unwrap(pair)[0] == pair:
        return pair
    return instance.GenerationResult(text=pair)


KNOWN_ARGS = "pretrained, device, ema, max_new_tokens, batch_size"


def _refuse(message: str) -> NoReturn:
    """A model that cannot be built: one line and exit code 2. lmms-eval catches any Exception from here, prints
    its traceback and exits 0 having evaluated nothing; a SystemExit passes through it."""
    log.configure()  # lmms-eval's process: no command of ours set the handler up
    _log.error(f"theworld: {one_line(message)}")
    raise SystemExit(2)


def _local_files(data_files) -> list[str]:
    """The local paths among a task's `dataset_kwargs.data_files` (a path, a list, or a dict of split to either):
    neither URLs (`hf://`, `https://`) nor glob patterns, which `datasets` resolves itself."""
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _local_files(v)]
    if isinstance(data_files, (list, tuple)):
        return [f for v in data_files for f in _local_files(v)]
    if isinstance(data_files, (str, os.PathLike)):
        f = os.fspath(data_files)
        return [] if location.is_url(f) or any(c in f for c in "*?[") else [f]
    return []


def _cause(error: BaseException) -> str:
    """The last try's error, and what raised it where that is another error (`datasets` wraps a parser's)."""
    first = error.last_attempt.exception()
    root = first
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    text = f"{type(first).__name__}: {first}" + ("" if root is first else f" (from {type(root).__name__}: {root})")
    return one_line(text, 400)


def _guard_task_data() -> None:
    """Make a task whose data does not load one line and exit code 2. lmms-eval loads each task's data after it
    builds the model (`ConfigurableTask.download`), retries a failure five times 2 s apart, then prints two
    tracebacks (tenacity's RetryError around the cause) and goes on; the adapter is the only code of ours in its
    process, so it wraps that method once: a local data file that does not exist is refused before any retry, and
    whatever else fails after lmms-eval's retries is named with its cause."""
    from lmms_eval.api.task import ConfigurableTask
    from tenacity import RetryError

    retried = ConfigurableTask.download
    if getattr(retried, "theworld_guard", False):
        return

    def download(self, dataset_kwargs=None) -> None:
        task = getattr(self.config, "task", None) or type(self).__name__
        for f in _local_files((dataset_kwargs or {}).get("data_files")):
            if not os.path.exists(f):
                where = "" if os.path.isabs(f) else f" (a relative path is read from {os.getcwd()})"
                _refuse(f"lmms-eval task {task}: data file {f} does not exist{where}")
        try:
            return retried(self, dataset_kwargs)
        except RetryError as e:
            _refuse(f"lmms-eval task {task}: its data did not load after lmms-eval's retries: {_cause(e)}")

    download.theworld_guard = True
    download.retried = retried
    ConfigurableTask.download = download


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


class TheWorldLMM(lmms):
    is_simple = True

    def __init__(
        self,
        pretrained: str | None = None,
        device: str | None = None,
        ema=False,
        max_new_tokens: int = 16,
        batch_size=1,
        **kwargs,
    ) -> None:
        super().__init__()
        _guard_task_data()
        if kwargs:
            _refuse(f"unknown model_args {', '.join(sorted(kwargs))} (known: {KNOWN_ARGS})")
        if not pretrained:
            _refuse("model_args needs pretrained=RUN (a final/ or checkpoint-N/ folder, or a run's output_dir)")
        try:
            self.max_new_tokens = int(max_new_tokens)
        except ValueError:
            self.max_new_tokens = 0
        if self.max_new_tokens < 1:
            _refuse(f"model_args max_new_tokens={max_new_tokens}: must be a whole number >= 1")
        from theworld.model.world import TheWorld

        try:
            self.model, self.processor = TheWorld.from_pretrained(pretrained, ema=_flag(ema), device=device)
        except UserError as e:
            _refuse(str(e))
        self.formatter = self.model.formatter
        self.device = self.model.input_device

    def _visuals(self, doc_to_visual, doc_id, task, split) -> list:
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        flat = [v for x in visuals for v in (x if isinstance(x, (list, tuple)) else [x])]
        if not flat:
            raise ValueError(f"theworld: {task}/{split} document {doc_id} has no image; the model needs one")
        return flat

    def _inputs(self, visuals: list) -> dict[str, torch.Tensor]:
        """World latents of the first image and image-token features of all of them (one prefix's worth)."""
        cfg = self.model.image_config
        loaded = [
            imagelib.for_model(imagelib.to_bytes(v), cfg.resolution, cfg.resize, self.processor.image_processor)
            for v in visuals
        ]
        mean, logvar = self.model.world_latents(loaded[0][0][None].to(self.device), None, None)
        siglip = self.model.image_features(torch.stack([pv for _, pv in loaded]).to(self.device), None)
        return {"latent_mean": mean, "latent_logvar": logvar, "siglip": siglip}

    @torch.no_grad()
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out: dict[int, tuple[float, bool]] = {}

        def key(k: int) -> tuple:  # (context, doc_id, task, split)
            return (requests[k].args[0], *requests[k].args[3:6])

        order = sorted(range(len(requests)), key=lambda k: tuple(map(str, key(k))))
        for (context, doc_id, task, split), group in groupby(order, key=key):
            group = list(group)
            visuals = self._visuals(requests[group[0]].args[2], doc_id, task, split)
            doc = self.task_dict[task][split][doc_id]
            targets = [t if isinstance(t, str) else t(doc) for t in (requests[k].args[1] for k in group)]
            prefix = self.formatter.prefix(context, images=len(visuals))
            rows = [self.formatter.encode(context, t, images=len(visuals)) for t in targets]
            world = self._inputs(visuals)
            scores, greedy = prefix_scoring.answer_logprobs(
                self.model, [prefix], rows, [0] * len(rows), greedy=True, **world
            )
            out.update({k: (-float(s), bool(g)) for k, s, g in zip(group, scores.tolist(), greedy.tolist())})
        return [_as_response(out[k]) for k in range(len(requests))]

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        tok, stop = self.processor.tokenizer, gen.stop_ids(self.model)
        sampler = gen.Sampler(False, 1.0, 1.0, None, self.device)
        answers = []
        for context, gen_kwargs, doc_to_visual, doc_id, task, split in (r.args for r in requests):
            visuals = self._visuals(doc_to_visual, doc_id, task, split)
            ids = self.formatter.prefix(context, images=len(visuals))
            prompt = prompt_only([ids], self.formatter.pad_id).to(self.device).with_inputs(**self._inputs(visuals))
            fused = gen.left_align(self.model.embed_inputs(prompt))
            n = int(gen_kwargs.get("max_new_tokens", self.max_new_tokens))
            new = gen.decode(self.model, fused, n, sampler, stop, tok.pad_token_id)[0]
            answer = gen.decode_text(tok, new)  # as TheWorld.generate decodes it
            until = gen_kwargs.get("until") or []
            for s in [until] if isinstance(until, str) else until:
                answer = answer.split(s, 1)[0] if s else answer
            answers.append(answer.strip())
        return answers

    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError("theworld: multi-round generation is not supported")
