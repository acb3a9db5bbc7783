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

from itertools import groupby
from typing import NoReturn

import torch
from lmms_eval.api.model import lmms

from theworld.core import log
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
