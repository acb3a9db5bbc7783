"""TheWorld: Gemma 3 + the Cosmos VAE world encoder + the world projector.

Sequence: [BOS, SOW, W1..WN, EOW, <start_of_turn>user ... <start_of_image> image tokens <end_of_image> prompt
<end_of_turn> <start_of_turn>model caption <end_of_turn>]. World tokens go right after BOS; every row has the same
number of them and rows are right-padded, so inserting them is one concatenation and positions stay 0..len-1 per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.profiler import record_function

from theworld.core.device import default_device
from theworld.core.errors import UserError
from theworld.infer import generate as generation
from theworld.model import device_map as dispatching
from theworld.model import encoders, objective
from theworld.model import lora as lora_adapters
from theworld.model import recompute as checkpointing
from theworld.model import stage_layout as layout
from theworld.model.arch import CHECKPOINT_PARTS, FREEZABLE, PARTS
from theworld.model.config import FreezeConfig, ImageConfig, LoraConfig, ModelConfig, WorldConfig
from theworld.model.encoders import WorldEncoder
from theworld.model.inputs import ModelInputs
from theworld.model.packing import Packed, use_segments
from theworld.model.projector import WorldProjector
from theworld.model.rollout import Rollout, at_inference, pixel_seeds, questions_of, with_predicted
from theworld.model.text import ChatFormatter

# record_function labels of a step's parts in the profiler's trace (tools.profile_report groups time by them)
PROFILE_LABELS = {
    part: f"theworld:{part}"
    for part in ("world_encoder", "projector", "vision_tower", "language_model", "backward", "optimizer", "data")
}


@dataclass
class Output:
    loss: torch.Tensor  # loss_sum / num_items (the caller's global count when given)
    loss_sum: torch.Tensor  # summed cross-entropy over this batch's answer tokens
    num_tokens: int  # answer tokens in this batch
    logits: torch.Tensor | None = None  # (B, L_fused, V), only with return_logits=True


@dataclass
class LoadReport:
    loaded: list[str]
    new: list[str]  # trainable here, absent from the file: kept as initialised
    ignored: list[str]  # in the file, but not a trainable parameter here
    merged: int = 0  # layers whose LoRA adapters (of a LoRA stage) were merged into their base weights

    def summary(self) -> str:
        return f"loaded {len(self.loaded)} tensors, {len(self.new)} new, {len(self.ignored)} ignored"


def compile_language_layers(gemma: nn.Module, **compile_kwargs) -> int:
    """torch.compile each decoder layer of Gemma's language model in place (torchtitan's per-block compile): the layers
    share one graph, and fusing Gemma's fp32 norms and gelu is where eager mode loses most time on a GPU."""
    layers = gemma.model.language_model.layers
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)


class TheWorld(nn.Module):
    def __init__(
        self, gemma: nn.Module, world_encoder: WorldEncoder | None, projector: WorldProjector, latent_mode: str = "mean"
    ):
        super().__init__()
        self.gemma = gemma
        self.world_encoder = world_encoder
        self.projector = projector
        self.latent_mode = latent_mode
        self.rollout: Rollout | None = None  # the Video2World pipeline of live rollouts (from_config, N > 0)
        self.rollout_steps = 0  # world.num_world_steps: with the pipeline not loaded, live latents are refused
        self.image_token_id = gemma.config.image_token_id
        self.softcap = getattr(gemma.config.get_text_config(), "final_logit_softcapping", None)
        # what `generate` needs to prepare raw images and prompts (set by from_config / from_pretrained)
        self.processor = None
        self.image_config = ImageConfig()

    @property
    def processor(self):
        return self._processor

    @processor.setter
    def processor(self, processor) -> None:
        # the chat formatter belongs with the processor it was built from, so the two never disagree
        self._processor = processor
        self.formatter = ChatFormatter(processor) if processor is not None else None

    # ------------------------------------------------------------------------------------------------ construction

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        world: WorldConfig,
        freeze: FreezeConfig | None = None,
        seed: int = 0,
        image: ImageConfig | None = None,
        lora: LoraConfig | None = None,
        *,
        rollout: bool = True,
    ):
        """(TheWorld, processor), base models loaded with `from_pretrained` in `model.dtype`, projector in fp32.
        `image`: the preprocessing `generate` applies to raw images (the cache's resolution and resize). `lora`:
        adapters on the named parts (theworld/model/lora.py). `rollout` (with world.num_world_steps > 0): load the
        Video2World pipeline for live rollouts (`world_latents`); False when every batch brings cached latents."""
        gemma, processor = encoders.load_gemma(model.gemma, model.dtype)
        vae = encoders.load_vae(model.vae, model.dtype)
        self = cls.from_modules(gemma, vae, world, freeze, seed, lora)
        self.rollout_steps = world.num_world_steps
        if rollout and world.num_world_steps:
            self.rollout = Rollout.load(model.vae, model.dtype, vae, world.num_world_steps, world.rollout)
        self.processor, self.image_config = processor, image or ImageConfig()
        return self, processor

    @classmethod
    def from_modules(
        cls,
        gemma: nn.Module,
        vae: nn.Module,
        world: WorldConfig,
        freeze: FreezeConfig | None = None,
        seed: int = 0,
        lora: LoraConfig | None = None,
    ):
        """TheWorld around loaded (or, for tools.memory_plan, meta-device) base models, with a fresh fp32 projector."""
        encoder = WorldEncoder(vae)
        self = cls(gemma, encoder, cls.new_projector(gemma, encoder, world, seed), world.latent)
        if lora is not None:  # after the projector: its initialisation stays what it was without LoRA
            lora_adapters.apply(gemma, lora)
        self.set_freeze(freeze or FreezeConfig())
        return self

    @staticmethod
    def new_projector(gemma: nn.Module, encoder: WorldEncoder, world: WorldConfig, seed: int) -> WorldProjector:
        """The fp32 projector as a run with this seed starts it (also the `init_projector` evaluation baseline)."""
        text_cfg = gemma.config.get_text_config()
        torch.manual_seed(seed)  # the projector's initialisation is part of the run's definition
        return WorldProjector(
            text_cfg.hidden_size,
            encoder.latents_mean,
            encoder.latents_std,
            latent_channels=encoder.vae.config.z_dim,
            pool=world.pool,
            arch=world.projector,
            embed_std=text_cfg.initializer_range,
            num_world_steps=world.num_world_steps,
            max_world_steps=world.max_world_steps,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | layout.Stage,
        *,
        ema: bool = False,
        device: str | torch.device | None = None,
        device_map: str | dict | None = None,
        offload_folder: str | Path | None = None,
        rollout: bool = True,
        world_steps: int | None = None,
    ):
        """(TheWorld, processor) of a trained stage, ready for inference: `path` is a final/ or checkpoint-N/ folder,
        or a run's output_dir (its final/), or its `layout.Stage` already read: trained tensors loaded (or their EMA),
        eval mode, base models in the config's model.dtype, world latents from the posterior mean, on `device`
        (default: cuda when available).
        `device_map` instead: Accelerate's big-model dispatch over GPUs, the CPU and disk ("auto", "cpu", "disk" or
        {module name: device}; disk weights live in `offload_folder`), theworld/model/device_map.py. `rollout`: as
        from_config (a stage with world.num_world_steps > 0 rolls out live unless False). `world_steps`: roll out this
        many predicted frames instead of the trained number (up to its temporal table: rollout.at_inference).
        Folder layout: theworld/model/stage_layout.py."""
        if device_map is not None:
            if device is not None:
                raise UserError("from_pretrained: give device or device_map, not both")
            dispatching.check(device_map, offload_folder)
        stage = path if isinstance(path, layout.Stage) else layout.read_stage(layout.resolve(path))
        folder, cfg = stage.folder, stage.sections
        if world_steps is not None:
            cfg = dataclasses.replace(cfg, world=at_inference(cfg.world, world_steps, str(path)))
        weights = folder / (layout.EMA if ema else layout.WEIGHTS)
        if ema and not weights.is_file():
            raise UserError(f"model {folder}: no {layout.EMA} (the run had train.optimizer.ema: 0)")
        model, processor = cls.from_config(
            cfg.model, cfg.world, cfg.freeze, image=cfg.image, lora=cfg.lora, rollout=rollout
        )
        model.load_trainable(weights, strict=True)  # the run's freeze flags define the set it must hold exactly
        model.requires_grad_(False)
        model.latent_mode = "mean"
        if device_map is not None:
            dispatching.dispatch(model.eval(), device_map, offload_folder)
            return model, processor
        device = device or default_device()
        return model.to(device).eval(), processor

    @contextlib.contextmanager
    def evaluating(self, keep_mode: bool = False):
        """Eval mode with world latents from the posterior mean (how every evaluation and inference reads the model),
        the caller's mode and latent mode restored after. `keep_mode`: leave train/eval mode as it is (generation
        from a model the caller already holds in eval mode)."""
        was_training, mode = self.training, self.latent_mode
        if not keep_mode:
            self.eval()
        self.latent_mode = "mean"
        try:
            yield self
        finally:
            self.latent_mode = mode
            if not keep_mode:
                self.train(was_training)

    @property
    def input_device(self) -> torch.device:
        """Where inputs go: the device of the weights, or a dispatched model's first device (device_map)."""
        return dispatching.input_device(self)

    # Parameters of an unfrozen part that a one-image forward never reaches: the vision tower's pooling head (Gemma
    # uses the patch tokens), the VAE's decoder side, and the encoder's temporal downsampling (a one-frame video skips
    # it). They would get no gradient, which multi-process (DDP) training refuses, so they stay frozen.
    OFF_PATH = re.compile(
        r"^gemma\.model\.vision_tower\.(.+\.)?head\.|^world_encoder\.vae\.(decoder|post_quant_conv)\."
        r"|^world_encoder\.vae\.encoder\..*\.time_conv\."
    )

    def set_freeze(self, freeze: FreezeConfig) -> None:
        if not freeze.vae and self.world_encoder is None:
            raise UserError("freeze.vae: false needs the VAE loaded (live encoding)")
        for name in FREEZABLE:
            if name == "vae" and self.world_encoder is None:  # cached latents only: no VAE loaded
                continue
            for path in PARTS[name]:
                self.get_submodule(path).requires_grad_(not getattr(freeze, name))
        for name, p in self.named_parameters():
            if self.OFF_PATH.match(name):
                p.requires_grad_(False)
            if lora_adapters.is_adapter(name):  # a LoRA part: its base weights stay frozen, its adapters train
                p.requires_grad_(True)
        self.projector.requires_grad_(True)

    def cast_trainable_to_fp32(self) -> None:
        """fp32 master weights for whatever trains; frozen base weights keep their (bf16) load dtype."""
        for p in self.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()

    def activation_checkpointing(
        self, mode: str = "full", every_n: int = 1, parts: Iterable[str] = CHECKPOINT_PARTS
    ) -> dict[str, int]:
        """Recompute the activations of `parts`' layers in the backward (`mode` full or selective, every `every_n`-th
        layer; none: off): theworld/model/recompute.py. Returns the layers wrapped per part."""
        return checkpointing.apply(self, mode, every_n, parts)

    def gradient_checkpointing(self, enable: bool) -> None:
        """The earlier switch: every layer of Gemma's two stacks, fully (train.hardware.gradient_checkpointing:
        true)."""
        self.activation_checkpointing("full" if enable else "none", parts=("language", "vision"))

    # ------------------------------------------------------------------------------------------------ forward

    def image_features(self, pixel_values: torch.Tensor | None, siglip: torch.Tensor | None) -> torch.Tensor:
        if siglip is not None:  # cached SigLIP + multimodal projector output: the vision tower never runs
            return siglip
        if pixel_values is None:
            raise ValueError("need pixel_values or cached siglip features for the image tokens")
        return self.gemma.model.get_image_features(pixel_values.to(self.gemma.dtype)).pooler_output

    def world_latents(
        self,
        images: torch.Tensor | None,
        mean: torch.Tensor | None,
        logvar: torch.Tensor | None,
        rollout_seeds: Sequence[int] | torch.Tensor | None = None,
        predict: bool = True,
        rollout_questions: Sequence[str] | torch.Tensor | None = None,
    ):
        """(mean, logvar) of the world block: the cached ones when given, else the VAE's posterior of `images`
        (B, C, 1, h, w), followed with a loaded rollout pipeline by each image's predicted frames (B, C, 1 + N, h, w;
        theworld/model/rollout.py). `rollout_seeds`: one per row (a list or a (B,) tensor), `rollout.sample_seeds(seed,
        keys)` with the cache's seed and the samples' keys reproduce a rollout cache; None: each row's seed from its
        pixels. `predict` False: the observed frame alone, without rolling out (what no_rollout uses of them). Predicted
        frames carry no gradient (the transformer is frozen); frame 0 keeps its gradient when the VAE trains.
        `rollout_questions` (world.rollout.condition: question): each row's question (strings, or
        `rollout.questions_tensor`'s bytes), which also enter the seeds drawn from pixels."""
        if mean is not None:
            return mean, logvar
        if images is None or self.world_encoder is None:
            raise ValueError("need cached latents (mean, logvar) or images plus a loaded VAE")
        if self.rollout_steps and self.rollout is None and predict:
            raise ValueError(
                f"world.num_world_steps {self.rollout_steps}: live world latents need the rollout pipeline, which "
                "this model was built without (from_config/from_pretrained with rollout=False): give cached latents"
            )
        mean, logvar = self.world_encoder(images)
        if self.rollout is None or not predict:
            return mean, logvar
        if isinstance(rollout_seeds, torch.Tensor):
            rollout_seeds = rollout_seeds.tolist()
        questions = None
        if self.rollout.condition == "question":
            if rollout_questions is None:
                raise ValueError("world.rollout.condition question: live rollouts need each row's question")
            questions = (
                questions_of(rollout_questions) if isinstance(rollout_questions, torch.Tensor) else rollout_questions
            )
        seeds = rollout_seeds if rollout_seeds is not None else pixel_seeds(images, questions=questions)
        return with_predicted(mean, logvar, self.rollout(images, seeds, questions))

    def fuse(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, world: torch.Tensor, image_feats: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Embeddings, mask, positions and token types of the fused sequence (world tokens after BOS)."""
        embed = self.gemma.get_input_embeddings()
        is_image = input_ids == self.image_token_id
        safe_ids = input_ids.masked_fill(is_image & (input_ids >= embed.num_embeddings), 0)
        text = embed(safe_ids)
        # .to(text.device): under a device_map the vision tower and the projector may sit on other devices
        text = text.masked_scatter(is_image.unsqueeze(-1), image_feats.to(text.device, text.dtype))
        b, n = world.shape[:2]
        embeds = torch.cat([text[:, :1], world.to(text.device, text.dtype), text[:, 1:]], dim=1)
        mask = torch.cat([attention_mask[:, :1], attention_mask.new_ones(b, n), attention_mask[:, 1:]], dim=1)
        types = torch.cat([attention_mask.new_zeros(b, 1 + n), is_image[:, 1:].long()], dim=1)  # BOS, world: text
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return {"inputs_embeds": embeds, "attention_mask": mask, "token_type_ids": types, "position_ids": positions}

    def forward(
        self, inputs: ModelInputs, *, num_items: int | torch.Tensor | None = None, return_logits: bool = False
    ) -> Output:
        """The answer-only loss of `inputs` (theworld/model/objective.py), normalised by `num_items` (the global batch's
        answer-token count) when given, else by this batch's."""
        hidden = self._hidden(inputs)
        loss_sum, n = objective.answer_loss(hidden[:, :-1], self._targets(inputs, hidden), self.logits)
        full = self.logits(hidden) if return_logits else None
        loss = loss_sum / num_items if num_items is not None else objective.per_token(loss_sum, n)
        return Output(loss=loss, loss_sum=loss_sum, num_tokens=n, logits=full)

    def embed_inputs(self, inputs: ModelInputs) -> dict:
        """The fused language-model inputs (see `fuse`) from token ids, world inputs and image inputs; with
        `inputs.use_world` False, no world block at all (no SOW, world or EOW tokens), Gemma 3 as its users know it;
        with `inputs.use_rollout` False, the world block of the observed frame alone (temporal row 0)."""
        # labels for the profiler's trace (python -m tools.profile_report groups its time by them)
        with record_function(PROFILE_LABELS["vision_tower"]):
            feats = self.image_features(inputs.pixel_values, inputs.siglip)
        if not inputs.use_world:
            none = feats.new_zeros(inputs.size, 0, self.gemma.config.get_text_config().hidden_size)
            return self.fuse(inputs.input_ids, inputs.attention_mask, none, feats)
        with record_function(PROFILE_LABELS["world_encoder"]):
            # no_rollout given live images: the observed frame's encoding alone, no rollout computed for it
            mean, logvar = self.world_latents(
                inputs.images,
                inputs.latent_mean,
                inputs.latent_logvar,
                inputs.rollout_seeds,
                inputs.use_rollout,
                inputs.rollout_questions,
            )
        with record_function(PROFILE_LABELS["projector"]):
            frames = None if inputs.use_rollout else 1  # the no_rollout baseline: the observed frame alone
            tokens = self.projector(mean, logvar, self.latent_mode, inputs.noise_seeds, frames)
        return self.fuse(inputs.input_ids, inputs.attention_mask, tokens, feats)

    def _hidden(self, inputs: ModelInputs) -> torch.Tensor:
        fused = self.embed_inputs(inputs)
        if inputs.pack_rows is not None:
            return self._packed_hidden(fused, inputs.pack_rows)
        with record_function(PROFILE_LABELS["language_model"]):
            return self.gemma.model(**fused, use_cache=False).last_hidden_state

    def _packed_hidden(self, fused: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """The language model's output on the fused samples laid out several to a row (theworld/model/packing.py),
        given back in the unpacked layout (zeros on padding)."""
        embeds = fused["inputs_embeds"]
        packed = Packed(fused["attention_mask"], rows)
        text_config = self.gemma.config.get_text_config()
        use_segments(text_config)
        masks = packed.masks(fused["token_type_ids"], text_config, embeds.dtype)
        with record_function(PROFILE_LABELS["language_model"]):
            out = self.gemma.model(
                inputs_embeds=packed.pack(embeds), attention_mask=masks, position_ids=packed.positions, use_cache=False
            ).last_hidden_state
        return packed.unpack(out, embeds)

    @staticmethod
    def _targets(inputs: ModelInputs, hidden: torch.Tensor) -> torch.Tensor:
        """The next-token targets of the fused sequence `hidden` holds (its world block after BOS)."""
        if inputs.labels is None:
            raise ValueError("the loss and answer log-probabilities need labels (a prompt-only batch has none)")
        n_world = hidden.shape[1] - inputs.labels.shape[1]
        return objective.shifted_targets(inputs.labels.to(hidden.device), n_world)[0]

    def answer_logprobs(self, inputs: ModelInputs) -> torch.Tensor:
        """(B,) float32: each row's summed log-probability of its answer tokens (objective.answer_logprobs).
        Multiple-choice scoring (theworld.evaluate) compares these across a question's choices."""
        hidden = self._hidden(inputs)
        return objective.answer_logprobs(hidden[:, :-1], self._targets(inputs, hidden), self.logits)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head with Gemma's final soft-capping."""
        logits = self.gemma.lm_head(hidden).to(hidden.device)  # a device_map may put lm_head elsewhere
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # ------------------------------------------------------------------------------------------------ inference

    def generate(
        self,
        images: list,
        prompts: str | list[str],
        *,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        use_cache: bool = True,
        world_images: list | None = None,
        seed: int | None = None,
    ) -> list[str]:
        """One answer per image (paths, bytes or PIL images) to its prompt (one string for all, or one each), through
        a KV cache (`use_cache=False` recomputes the whole sequence at every step; greedy output is the same). Stops
        at <end_of_turn> or EOS. `world_images`: take the world latents from these instead (one per image).
        See theworld/infer/generate.py."""
        return generation.generate(
            self,
            images,
            prompts,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            use_cache=use_cache,
            world_images=world_images,
            seed=seed,
        )

    # ------------------------------------------------------------------------------------------------ weights

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().contiguous() for n, p in self.named_parameters() if p.requires_grad}

    def save_trainable(self, path: str | Path) -> None:
        save_file({n: t.cpu() for n, t in self.trainable_state_dict().items()}, str(path))

    def load_trainable(self, path: str | Path, strict: bool = True) -> LoadReport:
        """Load trainable tensors by name. Shapes must match. strict: the file must hold exactly the trainable set."""
        return self.load_tensors(read_weights(path), path, strict)

    def load_tensors(self, tensors: dict[str, torch.Tensor], path: str | Path, strict: bool = True) -> LoadReport:
        """`load_trainable` of tensors already read from `path` (named in messages). A plain layer's weight goes into
        its frozen base when this model has LoRA adapters on that layer."""
        params = dict(self.named_parameters())
        tensors = {lora_adapters.adapted_name(n, params): t for n, t in tensors.items()}
        trainable = {n for n, p in params.items() if p.requires_grad}
        for name, t in tensors.items():
            if name in params and params[name].shape != t.shape:
                raise UserError(
                    f"{path}: tensor {name} has shape {tuple(t.shape)}, the model expects {tuple(params[name].shape)}"
                )
        report = LoadReport(
            loaded=sorted(set(tensors) & set(params)),
            new=sorted(trainable - set(tensors)),
            ignored=sorted(set(tensors) - set(params)),
        )
        if strict and (report.new or report.ignored or set(tensors) != trainable):
            raise UserError(
                f"{path}: weights do not match the trainable set ({report.summary()}; "
                f"first differing: {(report.new + report.ignored + sorted(set(tensors) - trainable))[:3]})"
            )
        with torch.no_grad():
            for name in report.loaded:
                params[name].copy_(local_like(params[name], tensors[name]))
        return report


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise UserError(f"no weights file at {path}")
    try:
        tensors = load_file(str(path))
    except OSError as e:  # another user's file (0600), an I/O error
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:  # a .bin, a torn copy: name the file rather than show safetensors' internals
        raise UserError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    layout.check_finite(tensors, path)
    return tensors


def local_like(ref: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full`, a whole tensor every process holds, laid out as `ref`: this process's slice when `ref` is a DTensor
    (a parameter sharded by FSDP2), else `full` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(ref, DTensor):
        return full
    # src_data_rank=None: every process has the whole tensor and keeps its own slice, without communicating
    d = distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)
    home = ref.to_local().device  # the host under FSDP's CPU offload, while the mesh is on the GPU
    if d.to_local().device == home:
        return d
    return DTensor.from_local(
        d.to_local().to(home), ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride()
    )
