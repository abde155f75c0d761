"""The run configuration: one typed tree, loaded from YAML, validated at load.

A run is described by one YAML file (or a preset shipped inside the package) plus
command-line overrides `--set key.sub=value`. Every key is checked when the file is
loaded, so a typo or a bad value fails before any weight is read, with one message that
names the file, the key path, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from loom_live.host_bridge.wire import params as live
from loom_live.host_bridge.wire.typed_config import (
    ConfigError,
    apply_override,
    build,
    did_you_mean,
    parse_override,
    spec,
    to_dict,
)

__all__ = ["ConfigError", "LoomConfig", "load_config", "list_presets", "DEFAULT_PRESET"]

DEFAULT_PRESET = "default"
CPU_PRESETS = ("tiny", "embedded", "tiny-vace")  # DiT presets small enough to stream on a CPU (default, tests)
# a preset on random weights with the hash text encoder, what `loom bench` and the benchmarks run: speed does not
# depend on weight values, and a prompt is encoded once, not per chunk
RANDOM_WEIGHTS = ("model.random_weights=true", "vae.random_weights=true", "prompt.encoder=hash")
VACE_PRESETS = ("tiny-vace", "wan2.1-vace-1.3b", "wan2.1-vace-14b")  # DiTs with VACE control blocks
# DiTs that read their input's edge strength (DIT_PRESETS' `source_edges`; named here, the config loads without
# torch): the edges are their structure control, scaled by control.context_scale
EDGE_PRESETS = ("embedded",)
PRESET_PACKAGE = "loom_live.engine.presets"
# latent frames of a stream's first chunk (the causal VAE's first frame alone, then groups of CHUNK_FRAMES):
# the KV window must hold them
FIRST_CHUNK_LATENTS = 1 + (live.FIRST_CHUNK_FRAMES - 1) // live.CHUNK_FRAMES


# the Wan family's keys the edit family does not read (engine/edit reads model.family, device, dtype, seed,
# random_weights and cpu_threads, resolution, prompt.text, slo and edit), by section; None: every key of it.
# The other model and vae keys are left alone: `loom bench` and `loom prepare` set them whatever the family
WAN_ONLY_KEYS: dict[str, tuple[str, ...] | None] = {
    "model": ("preset", "checkpoint"), "vae": ("checkpoint", "taehv_checkpoint", "dtype"),
    "prompt": ("encoder", "path"), "stream": None, "noise": None, "memory": None, "control": None}

# what YAML reads as null: a `--set` of a text key to one of these unsets it
YAML_NULLS = ("null", "Null", "NULL", "~")

# compiled steps saved whole (engine/graphs/saved_compiles.py): "none" is spelt out, since YAML reads off as false
SAVED_CHOICES = ("load", "build", "none")


DEVICE_SETTINGS = "auto, cpu, cuda or cuda:N"


def is_device_setting(text: str) -> bool:
    """Whether `text` is one of DEVICE_SETTINGS (model.device, and the commands' own --device)."""
    head, _, idx = text.partition(":")
    return text in ("auto", "cpu", "cuda") or (head == "cuda" and idx.isdigit())


@dataclass
class ModelConfig:
    """The denoiser: a DiT preset and optional weights."""

    family: str = spec("wan", choices=("wan", "edit"),
                       doc="wan: the causal Wan DiT; edit: the MLLM-conditioned edit UNet (the `edit` section)")
    preset: str = spec("tiny", choices=("tiny", "embedded", "wan2.1-1.3b", "wan2.1-14b") + VACE_PRESETS,
                        doc="DiT architecture; embedded = the trained default (with its own VAE and style text); "
                            "*vace*: with VACE structure control (the `control` section)")
    checkpoint: str | None = spec(None, doc="DiT weights (file, sharded index or directory; for the embedded preset "
                                      "a `loom train fit` weights file); none = random/embedded")
    dtype: str = spec("auto", choices=("auto", "float32", "bfloat16", "float16"),
                      doc="compute dtype; auto = bfloat16 on CUDA, float32 on CPU (the embedded preset: "
                          "bfloat16 where the CPU has AMX or AVX512-BF16)")
    device: str = spec("auto", doc=DEVICE_SETTINGS)
    cpu_threads: int = spec(0, min=0, max=1024, doc="torch threads of an engine on a CPU; 0 = one less than "
                                                    "its cores (the host gets one), at least 1")
    seed: int = spec(0, min=0, doc="seed of the embedded default weights when no checkpoint is given")
    random_weights: bool = spec(False, doc="run a real-size preset on random weights (benchmarks only)")
    fuse_elementwise: bool = spec(True, doc="compile the DiT blocks' norm/modulation/gate/RoPE steps and the "
                                            "VACE edges' hysteresis on CUDA (needs triton)")
    gelu_epilogue: bool = spec(True, doc="with fuse_elementwise on CUDA: the FFN's GELU as its first matmul's "
                                         "cuBLASLt epilogue (off: a GELU pass of its own)")
    saved_block_ops: str = spec("load", choices=SAVED_CHOICES,
                                doc="with fuse_elementwise on CUDA: each compiled block function kept whole per "
                                    "argument signature in the compile cache folder; load: a start loads those "
                                    "there instead of tracing them (the others compile as usual); build: also "
                                    "builds and keeps the missing ones (a longer start once: `loom prepare`); "
                                    "none: the folder unused (torch's experimental aot_compile; any failure falls "
                                    "back to torch.compile)")
    autotune_kernels: bool = spec(False, doc="on CUDA, the Wan engine's compiled kernels (DiT and VAE): Triton times "
                                             "several block sizes for each elementwise and reduction kernel at its "
                                             "first launch (a longer cold start, kept by the compile cache); off: "
                                             "Inductor's heuristic pick, one each")
    fuse_qkv: bool = spec(False, doc="on CUDA: each block's q/k/v projections as one matrix product over a "
                                     "fused weight (one kernel whose grid fills a large GPU at one latent frame's "
                                     "tokens); fp8_linear always runs them as one FP8 product")
    attention_splits: int = spec(1, min=1, max=16,
                                 doc="on CUDA: the self-attention over the KV window as this many parts of the "
                                     "window in one batched call, merged exactly (fills a large GPU when a chunk "
                                     "has few queries and the model few heads); must divide stream.num_kv_cache")
    masked_sink_merge: bool = spec(True, doc="with fuse_elementwise on CUDA: the sink merge as a Triton write of "
                                              "only the slot that takes the frame (the compiled merge rewrites "
                                              "every sink slot in every block of every forward)")
    fp8_linear: bool = spec(False, doc="Hopper/Ada: FP8 e4m3 matmuls in the DiT blocks; see docs/performance.md "
                                       "for the quality impact")
    fp8_quantize: str = spec("auto", choices=("auto", "compiled", "triton"),
                             doc="with fp8_linear: how activations are quantised per row: one-pass Triton "
                                 "kernels (one read of the row where Inductor's loop reads it twice), compiled "
                                 "torch functions, or auto: the kernels where triton is installed")

    def __post_init__(self) -> None:
        if not is_device_setting(self.device):
            raise ValueError(f"device: {self.device!r} is not allowed; expected {DEVICE_SETTINGS}")


def _first_set(section: Any, keys: tuple[str, ...] | None = None) -> str | None:
    """The first of `keys` (None: every key) of a config section whose value is not its default, or None."""
    default = type(section)()
    return next((f.name for f in dataclasses.fields(section) if (keys is None or f.name in keys)
                 and getattr(section, f.name) != getattr(default, f.name)), None)


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if key else section


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass
class VAEConfig:
    """The pixel <-> latent stage: the full Wan VAE or the tiny TAEHV one, each way."""

    preset: str = spec("tiny", choices=("tiny", "wan2.1"), doc="Wan VAE architecture")
    checkpoint: str | None = spec(None, doc="Wan2.1_VAE.pth or diffusers AutoencoderKLWan weights")
    encoder: str = spec("wan", choices=("wan", "taehv"), doc="which VAE encodes")
    decoder: str = spec("wan", choices=("wan", "taehv"), doc="which VAE decodes")
    taehv_checkpoint: str | None = spec(None, doc="taew2_1.pth, needed when encoder or decoder is taehv")
    random_weights: bool = spec(False, doc="random weights when no checkpoint is given (benchmarks, tests)")
    fuse_norms: bool = spec(True, doc="compile the Wan VAE's norm+SiLU steps on CUDA (needs triton)")
    compile_step: bool = spec(True, doc="compile the whole Wan VAE encoder and decoder on CUDA (needs triton; "
                                        "a longer warm-up for faster VAE chunks)")
    tune_kernels: bool = spec(False, doc="with compile_step: Inductor times block sizes for each fused VAE kernel "
                                         "(coordinate descent; a longer cold compile, kept by the compile cache)")
    saved_steps: str = spec("load", choices=SAVED_CHOICES,
                            doc="with compile_step: each compiled VAE step kept whole (Dynamo's output included) "
                                "in the compile cache folder; load, build, none as model.saved_block_ops")
    upsample: str = spec("phase", choices=("nearest", "phase", "transposed"),
                         doc="the Wan decoder's x2 upsampling + 3x3 conv: as written (nearest), or as four 2x2 "
                             "phase convs on the small input (phase: one conv + interleave; transposed: one "
                             "stride-2 transposed conv); the same result up to float rounding")
    channels_last: bool = spec(True, doc="channels-last weights and activations for the Wan VAE on CUDA")
    dtype: str = spec("auto", choices=("auto", "float32", "bfloat16", "float16"),
                      doc="the Wan VAE's compute dtype; auto = the model's (model.dtype). float16 keeps more "
                          "mantissa than bfloat16 where its values fit (to 65504), and on a GPU cuDNN then "
                          "searches all its convolution kernels and finds faster ones (docs/performance.md); "
                          "latents and frames cross to the model's dtype at the VAE's edges; a chunk past that "
                          "range is counted (vae_nonfinite_chunks) and starts a new stream (vae_restarts)")
    attention: str = spec("kernel", choices=("kernel", "matmul"),
                          doc="the Wan VAE's mid-block attention (one head of 384 channels): torch's attention "
                              "kernel, or two matrix products with float32 scores around a softmax (matmul); the "
                              "same result up to float rounding")
    thin_convs: str = spec("both", choices=("none", "taps", "stack", "both", "wide"),
                           doc="on CUDA, the Wan VAE's full-resolution convs with 3 channels on one side as other "
                               "convs of a better shape: the decoder's last (taps), the encoder's first (stack), "
                               "both or none; wide: both, and the 96-channel convs as 2D convs over stacked "
                               "frames too; the same result up to float rounding")
    normalize_on_encode: bool = spec(False, doc="scale encoder output by the per-channel latent mean/std")
    denormalize_on_decode: bool = spec(True, doc="undo the per-channel latent normalisation before decoding")


@dataclass
class Resolution:
    """The model's working resolution (input frames are resized to it)."""

    width: int = spec(128, min=16, max=4096, multiple_of=16)
    height: int = spec(128, min=16, max=4096, multiple_of=16)
    resize: str = spec("crop", choices=("crop", "fit", "stretch"),
                       doc="crop: fill and centre-crop; fit: letterbox; stretch: ignore aspect")


@dataclass
class StreamConfig:
    """Denoising schedule and the KV-cache window."""

    steps: list[int] = live.STEPS.field()
    mode: str = live.MODE.field()
    num_kv_cache: int = spec(6, min=FIRST_CHUNK_LATENTS, max=64,
                             doc=f"latent frames kept in the KV window (at least {FIRST_CHUNK_LATENTS}: a "
                                 f"stream's first chunk, {live.FIRST_CHUNK_FRAMES} frames, is that many latent frames)")
    sink: int = spec(3, min=0, max=63, doc="of which sink frames kept from the stream start")
    sink_threshold: float = live.SINK_THRESHOLD.field()
    rope_policy: str = spec("refresh", choices=("refresh", "window"), doc="how RoPE positions stay bounded")
    rope_refresh_at: int = spec(50, min=2, max=1000, doc="latent-frame index at which refresh moves back")
    timestep_shift: float = spec(8.0, min=0.1, max=100.0, doc="flow-matching sigma shift")
    seed: int = spec(0, min=0, doc="noise seed; same seed and input give the same output")
    cuda_graphs: bool = spec(True, doc="replay the fixed-shape DiT and VAE chunk steps as CUDA graphs")
    max_unfinished_chunks: int = spec(1, min=0, max=4,
                                      doc="chunks a push may leave running on the GPU; 1 lets the next chunk's "
                                          "encode overlap this one's denoise and decode, 0 = each push "
                                          "returns its own frames")
    decode_priority: bool = spec(True, doc="run the decode (the output a viewer waits for) on the highest-priority "
                                           "CUDA stream; off: every stream at the default priority, to compare, or "
                                           "where the denoise bounds the frame rate and must not yield SMs to it")
    lora_priority: bool = spec(True, doc="merge a live LoRA scale change on a CUDA stream of its own at the "
                                         "highest priority, so the next forward waits less for it; off: on "
                                         "the denoise stream, to compare")
    lora_merge_parts: int = spec(4, min=1, max=32,
                                 doc="a live LoRA scale change merges in this many parts of the layers, one "
                                     "part a chunk, so no chunk carries the whole merge (the change reaches "
                                     "every block within that many chunks); 1: all at the chunk it arrives. "
                                     "Pipeline ranks merge a change at once, each only its own blocks")

    def __post_init__(self) -> None:
        if self.sink >= self.num_kv_cache:
            raise ValueError(f"sink: {self.sink} must be smaller than num_kv_cache ({self.num_kv_cache})")
        if self.rope_policy == "refresh" and self.rope_refresh_at <= self.num_kv_cache:
            raise ValueError(f"rope_refresh_at: {self.rope_refresh_at} must be larger than num_kv_cache "
                             f"({self.num_kv_cache}) with the refresh policy")
        problem = live.STEPS.problem(self.steps)  # what the field's constraints cannot say: descending
        if problem is not None:
            raise ValueError(problem)


@dataclass
class NoiseConfig:
    """Motion-aware noise: more motion, less noise (StreamDiffusionV2's controller)."""

    motion_aware: bool = live.MOTION_AWARE.field()
    noise_scale: float = live.NOISE_SCALE.field()
    estimator: str = spec("frame_diff", choices=("frame_diff", "farneback", "dis"),
                          doc="motion estimate: pixel difference, or optical flow on a worker thread")
    ema: float = spec(0.9, min=0.0, max=1.0, doc="weight of the new estimate in the running scale")


@dataclass
class PromptConfig:
    """Text conditioning."""

    text: str = live.PROMPT.field()
    encoder: str = spec("hash", choices=("hash", "style", "file", "umt5"),
                        doc="hash: small deterministic encoder; style: the embedded model's prompt -> style table; "
                            "file: precomputed embeddings; umt5: local model")
    path: str | None = spec(None, doc="embeddings file (encoder=file) or umT5 directory (encoder=umt5)")
    device: str = spec("auto", choices=("auto", "cpu", "cuda"), doc="where the text encoder runs")
    transition_chunks: int = live.TRANSITION_CHUNKS.field()
    blend: str = spec("slerp", choices=("linear", "slerp"))

    def __post_init__(self) -> None:
        problem = live.PROMPT.problem(self.text)
        if problem is not None:
            raise ValueError(problem)


@dataclass
class SLOConfig:
    """Service-level targets the scheduler keeps."""

    target_fps: float = live.TARGET_FPS.field()
    latency_budget_ms: float = live.LATENCY_BUDGET_MS.field()


@dataclass
class MemoryConfig:
    """Fitting smaller GPUs (the 1.3B pipeline on a 24 GB card)."""

    low_vram: bool = spec(False, doc="text encoder on the CPU, one-latent chunks, VAE run in spatial tiles, "
                                          "stages one after another (no overlap of chunks)")
    vae_tile_latents: int = spec(32, min=4, max=512, doc="low_vram: VAE tile side in latents (8 pixels each)")
    vae_tile_overlap: int = spec(8, min=0, max=256, doc="low_vram: overlap of neighbouring tiles in latents")

    def __post_init__(self) -> None:
        if self.vae_tile_overlap >= self.vae_tile_latents:
            raise ValueError(f"vae_tile_overlap: {self.vae_tile_overlap} must be smaller than vae_tile_latents "
                             f"({self.vae_tile_latents})")


@dataclass
class ParallelConfig:
    """Pipeline parallelism of the DiT over several GPUs (engine/parallel/session.py)."""

    gpus: int = spec(1, min=1, max=64, doc="pipeline ranks, one GPU each; 1 = one GPU, no pipeline "
                                           "(on a CPU device the ranks are processes: tests)")
    split: list[int] = spec(default_factory=list, min=0, max=1000, max_len=64,
                            doc="DiT blocks per rank at the start, e.g. [20, 10]; 0 only on the first rank "
                                "(VAE encode) or the last (VAE decode); empty = an even split")
    rebalance: bool = spec(True, doc="move block boundaries between ranks while streaming when the measured "
                                     "stage times are unbalanced (the output is the same either way)")
    rebalance_threshold: float = spec(0.1, min=0.0, max=10.0,
                                      doc="move a boundary only when the slowest stage would be this fraction "
                                          "faster (hysteresis)")
    rebalance_dwell_chunks: int = spec(24, min=1, max=100000,
                                       doc="chunks measured after a start or a move before the next move")
    rank_timeout_s: float = spec(1.5, min=0.2, max=600.0,
                                 doc="a rank whose heartbeat is older than this is hung: the engine stops "
                                     "(on GPUs once warmed up)")

    def __post_init__(self) -> None:
        if self.split and len(self.split) != self.gpus:
            raise ValueError(f"split: {self.split} has {len(self.split)} entries for gpus={self.gpus}; "
                             "give one block count per GPU, or none for an even split")


@dataclass
class LoraEntry:
    """One style LoRA merged into the DiT's weights (engine/models/lora.py)."""

    path: str = spec(doc="LoRA file: diffusers/PEFT, original Wan or kohya/musubi layout (.safetensors/.pt)")
    scale: float = spec(live.LORA_DEFAULT_SCALE, min=live.LORA_SCALES.min, max=live.LORA_SCALES.max,
                        doc="strength; changed live with the lora_scales parameter")
    name: str | None = spec(None, doc="name for live control; default: the file name without extension")

    @property
    def key(self) -> str:
        return self.name or live.lora_name(self.path)


@dataclass
class ControlConfig:
    """Structure control: for a *vace* model preset the control video, its strength, a reference image; for
    a model that reads its input's edges (the embedded one) their strength (context_scale, control_source
    edges)."""

    control_source: str = live.CONTROL.field()
    context_scale: float = live.CONTEXT_SCALE.field()
    video: str | None = spec(None, doc="control video file read beside the input (control_source=video), frame "
                                       "by frame, looping; without it the host gives control frames with the input")
    depth_model: str | None = spec(None, doc="depth estimation model directory for control_source=depth "
                                             "(transformers, e.g. Depth Anything V2 small); loaded at start")
    reference: str | None = spec(None, doc="reference image file: a fixed first entry of the stream that sets "
                                           "the look")
    batched_encode: bool = spec(False, doc="encode the control video in the input's VAE call (one call on a batch "
                                           "of two streams) instead of a call of its own")


@dataclass
class EditConfig:
    """The edit family (engine/edit): DreamLite-mobile UNet, Qwen3-VL conditioning, temporal LLLite."""

    unet: str = spec("tiny", choices=("tiny", "dreamlite-mobile"),
                     doc="edit UNet architecture (dreamlite-mobile: the released DreamLite UNet); a checkpoint's "
                         "own unet/config.json wins")
    checkpoint: str | None = spec(None, doc="DreamLite directory in diffusers' layout (unet/, vae/, scheduler/; "
                                            "`loom pull dreamlite-edit`) or UNet weights file; none = seeded tiny "
                                            "weights, or random with model.random_weights")
    vae: str = spec("tiny", choices=("tiny", "taesd"), doc="tiny autoencoder architecture")
    vae_checkpoint: str | None = spec(None, doc="autoencoder weights; none = from checkpoint's vae/ or random")
    encoder: str = spec("hash", choices=("hash", "qwen3-vl"),
                        doc="hash: small deterministic stand-in; qwen3-vl: the vision-language encoder")
    encoder_path: str | None = spec(None, doc="Qwen3-VL-2B directory; none with qwen3-vl = random weights "
                                              "(needs model.random_weights)")
    batch: int = spec(8, min=1, max=64, doc="frames per UNet call (B); outputs lag by up to one batch")
    steps: int = spec(1, min=1, max=4, doc="Euler flow-matching steps")
    prompt_refresh_every: int = live.PROMPT_REFRESH_EVERY.field()
    prompt_one_frame: bool = spec(True, doc="encode one frame per refresh and broadcast it to the batch")
    encoder_split: int = spec(1, choices=(1, 2, 3),
                              doc="batches one refresh is spread over, so that no UNet batch meets the whole "
                                  "encoder burst: 1 = all at once; 2 = vision tower, then language model; 3 = "
                                  "vision tower, then each half of the language model. Each extra batch delays "
                                  "the new conditioning by one batch")
    lllite: str | None = spec(None, doc="temporal LLLite weights (safetensors); none = zero-initialised adapter")
    lllite_hooks: str = spec("down", choices=("all", "down", "none"),
                             doc="hooked attention projections: all, the down blocks only, or none")
    adapter_strength: float = live.ADAPTER_STRENGTH.field()
    cond_refresh_every: int = live.COND_REFRESH_EVERY.field()
    flow: str = spec("farneback", choices=("farneback", "none"),
                     doc="warp the previous output to the new frames for the adapter's condition")
    compile: bool = spec(True, doc="torch.compile the UNet + adapter as one graph (CUDA; needs triton)")
    two_streams: bool = spec(True, doc="side stream (encoders) beside the main stream (UNet, decode)")
    main_priority: bool = spec(False, doc="run the main stream (UNet, decode) at the highest CUDA priority, above "
                                          "the encoders' streams; off by default: the side's encode then waits "
                                          "behind the UNet and comes back in the tail latency")
    seed: int = spec(0, min=0, doc="noise seed; the same noise is used for every frame")


@dataclass
class LoomConfig:
    """Everything a run needs; built only through `load_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    resolution: Resolution = field(default_factory=Resolution)
    stream: StreamConfig = field(default_factory=StreamConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: list[LoraEntry] = spec(default_factory=list, max_len=live.LORA_SCALES.max_len,
                                 doc="style LoRAs, each with its own scale")
    edit: EditConfig = field(default_factory=EditConfig)
    control: ControlConfig = field(default_factory=ControlConfig)

    def __post_init__(self) -> None:
        names = [e.key for e in self.lora]
        if len(set(names)) != len(names):
            raise ValueError(f"lora: two LoRAs share a name ({', '.join(names)}); give each a distinct name")
        if self.lora and self.model.fp8_linear:
            raise ValueError("lora: LoRAs merge into bf16/float32 weights; turn model.fp8_linear off to use them")
        if self.stream.num_kv_cache % self.model.attention_splits:
            raise ValueError(f"model.attention_splits: {self.model.attention_splits} does not divide "
                             f"stream.num_kv_cache ({self.stream.num_kv_cache}); allowed: "
                             f"{_divisors(self.stream.num_kv_cache)}")
        if self.model.family == "edit" and self.parallel.gpus > 1:
            raise ValueError("parallel.gpus: the edit family runs on one GPU; set parallel.gpus=1")
        if self.model.family == "edit" and self.model.dtype == "float16":
            raise ValueError("model.dtype: float16 overflows the edit family's Qwen3-VL conditioning (hidden "
                             "states peak near 1160); use auto, bfloat16 or float32")
        if self.vae.dtype != "auto" and "wan" not in (self.vae.encoder, self.vae.decoder):
            raise ValueError(f"vae.dtype: {self.vae.dtype} is the Wan VAE's, and this run encodes and decodes "
                             "with taehv; leave vae.dtype at auto, or set vae.encoder or vae.decoder to wan")
        self._refuse_other_family()
        self._check_control()
        self._refuse_unused_paths()
        if self.memory.low_vram and self.prompt.device == "cuda":
            raise ValueError("prompt.device: 'cuda' contradicts memory.low_vram=true, which runs the text encoder "
                             "on the CPU; use prompt.device=auto or cpu, or turn low_vram off")

    def _refuse_other_family(self) -> None:
        """A key only the other model family reads is a mistake to say, not to ignore (`--lora` on an edit
        preset ran without the LoRA, `--set edit.batch=4` on a Wan preset changed nothing: both exit 0)."""
        family = self.model.family
        if family == "wan":
            unread = {"edit": _first_set(self.edit)}
        else:
            unread = {"lora": "" if self.lora else None}
            unread.update({s: _first_set(getattr(self, s), keys) for s, keys in WAN_ONLY_KEYS.items()})
        for section, key in unread.items():
            if key is not None:
                other = "wan" if family == "edit" else "edit"
                raise ValueError(f"{_join(section, key)}: model.family={family} does not read it (a key of the "
                                 f"{other} family); leave it out, or set model.family={other}")

    def _refuse_unused_paths(self) -> None:
        """A weights path the run would not read is a mistake to say, not to ignore (a VAE checkpoint given
        to a run on the tiny VAE restyles with the tiny VAE)."""
        vae, parts = self.vae, (self.vae.encoder, self.vae.decoder)
        if vae.checkpoint and "wan" not in parts:
            raise ValueError(f"vae.checkpoint: this run does not read it: the Wan VAE's weights are read only "
                             f"when vae.encoder or vae.decoder is wan (here {vae.encoder} and {vae.decoder})")
        if vae.taehv_checkpoint and "taehv" not in parts:
            raise ValueError(f"vae.taehv_checkpoint: this run does not read it: the tiny VAE's weights are read "
                             f"only when vae.encoder or vae.decoder is taehv (here {vae.encoder} and {vae.decoder})")
        if self.prompt.path and self.prompt.encoder not in ("file", "umt5"):
            raise ValueError(f"prompt.path: this run does not read it: only prompt.encoder file or umt5 reads a "
                             f"path (here {self.prompt.encoder})")
        self._refuse_unread_edit_paths()

    def _refuse_unread_edit_paths(self) -> None:
        """An edit-family path its own settings leave unread (the other family's keys: `_refuse_other_family`)."""
        e = self.edit
        if self.model.family != "edit":
            return
        if e.encoder_path and e.encoder != "qwen3-vl":
            raise ValueError(f"edit.encoder_path: this run does not read it: only edit.encoder=qwen3-vl reads "
                             f"it (here {e.encoder})")
        if e.lllite and e.lllite_hooks == "none":
            raise ValueError("edit.lllite: this run does not read it: edit.lllite_hooks=none hooks no adapter; "
                             "set lllite_hooks to down or all, or leave edit.lllite out")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @property
    def vace(self) -> bool:
        """Whether the DiT has VACE control blocks (the `control` section applies)."""
        return self.model.family == "wan" and self.model.preset in VACE_PRESETS

    @property
    def source_edges(self) -> bool:
        """Whether the DiT reads its input's edges, scaled by control.context_scale (the embedded model)."""
        return self.model.family == "wan" and self.model.preset in EDGE_PRESETS

    @property
    def structure_control(self) -> bool:
        """Whether the model takes the `control` section: VACE control blocks, or edges it reads."""
        return self.vace or self.source_edges

    @property
    def control_sources(self) -> tuple[str, ...]:
        """The control sources a run of this config can switch between live: none without structure control;
        edges alone for a model that reads its input's edges; for VACE depth only with its model, video only with
        a control video (`--control FILE`) or a host that gives control frames."""
        if not self.structure_control:
            return ()
        if not self.vace:
            return ("edges",)
        c = self.control
        return tuple(s for s in live.CONTROL_SOURCES if (s != "depth" or c.depth_model) and (s != "video" or c.video
                                                                                        or c.control_source == "video"))

    def _check_control(self) -> None:
        c = self.control
        if self.source_edges:
            given = [f"{k}={getattr(c, k)}" for k in ("video", "depth_model", "reference") if getattr(c, k)]
            if c.control_source != "edges":
                given.insert(0, f"control_source={c.control_source}")
            if given:
                raise ValueError(f"control.{given[0]}: model preset {self.model.preset!r} takes only its input's "
                                 f"edges (control_source=edges, strength control.context_scale); other sources "
                                 f"and a reference need a *vace* preset ({', '.join(VACE_PRESETS)})")
            return
        if not self.vace:
            given = [k for k in ("video", "depth_model", "reference") if getattr(c, k)]
            if given:
                raise ValueError(f"control.{given[0]}: structure control needs a VACE model; set model.preset to one "
                                 f"of {', '.join(VACE_PRESETS)}")
            return
        if self.parallel.gpus > 1:
            raise ValueError("parallel.gpus: VACE control runs on one GPU; set parallel.gpus=1")
        if c.control_source == "depth" and not c.depth_model:
            raise ValueError("control.depth_model: control_source 'depth' needs a depth model directory "
                             "(e.g. Depth Anything V2 small for transformers)")
        if c.reference and self.stream.sink < 1:
            raise ValueError("control.reference: the reference is the stream's first sink; set stream.sink >= 1")

    def lora_with_scales(self, scales: Any) -> list[LoraEntry]:
        """The LoRA entries with live `lora_scales` applied (None: as they are); ValueError naming an
        unknown LoRA or a scale out of range, before anything changes."""
        if scales is None:
            return self.lora
        if not isinstance(scales, dict):
            raise ValueError(f"lora_scales: {scales!r} is not allowed; expected a mapping of LoRA name to scale")
        names = [e.key for e in self.lora]
        for name in scales:
            if name not in names:
                raise ValueError(f"lora_scales: no LoRA named {name!r}; loaded: {', '.join(names) or 'none'}")
        return [build(LoraEntry, {**e.__dict__, "scale": scales.get(e.key, e.scale)}, source="set_params",
                      path=f"lora_scales.{e.key}") for e in self.lora]

    @property
    def live_params(self) -> tuple[live.LiveParam, ...]:
        """The share of the live schema this config's sessions take (`host_bridge/wire/params.py`)."""
        return live.family_params(self.model.family, self.structure_control)

    def with_live(self, params: dict[str, Any]) -> LoomConfig:
        """This config with live `params` applied, each validated exactly as its config-file section is
        (the same words for the same refusal); ValueError names an unknown key (allowed: `live_params`,
        the family's share of the schema, named in the message) or a bad value, before anything changes.
        `lora_scales` changes the scales of the `lora` list (`lora_with_scales`)."""
        names = {p.name: p for p in self.live_params}
        unknown = [k for k in params if k not in names]
        if unknown:
            family = " for the edit family" if self.model.family == "edit" else ""
            raise ValueError(f"unknown parameter {unknown[0]!r}{family}; settable: {', '.join(names)}")
        params = dict(params)
        new = self
        if live.LORA_SCALES.name in params:
            new = new.replace(lora=self.lora_with_scales(params.pop(live.LORA_SCALES.name)))
        for section in dict.fromkeys(names[k].section for k in params):
            data = {**getattr(new, section).__dict__,
                    **{k: v for k, v in params.items() if names[k].section == section}}
            new = new.replace(**{section: build(type(getattr(new, section)), data, source="set_params",
                                                path=section)})
        return new

    def start_settings(self) -> dict[str, Any]:
        """What a session of this config starts on, as its `ready` message tells the host (JSON-able): the
        prompt's text and each live parameter it takes (`live_params`) by name, with this config's value
        (`lora_scales`: the `lora` list's scales by name), the model family, so that the host says an empty
        prompt in its words, and its structure control (`control_sources`, and whether it takes a reference image),
        so that a host attached to it refuses what it cannot make. `with_live` of these params changes nothing."""
        params = {}
        for p in self.live_params:
            if p is live.LORA_SCALES:
                params[p.name] = {e.key: e.scale for e in self.lora}
            else:
                params[p.name] = p.check(getattr(getattr(self, p.section), p.name))
        return {"prompt": self.prompt.text, "params": params, "family": self.model.family,
                "control_sources": list(self.control_sources), "takes_reference": self.vace}

    def replace(self, **sections: Any) -> LoomConfig:
        return dataclasses.replace(self, **sections)


def list_presets() -> list[str]:
    """Names of the presets shipped inside the package."""
    folder = resources.files(PRESET_PACKAGE)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (PyYAML keeps the last one, so a
    section written twice would lose the first silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{_name(key)} is written twice; write each key once", key_node.start_mark)
            if isinstance(key, str | int | float | bool):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 (and JSON) read 1e3, 5e-1 and 1.5e3 as numbers; PyYAML's YAML 1.1 wants a dot and a signed
# exponent (1.0e+3), made them strings, and a number key refused '5e-1' as not a number
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"))


def _name(key: Any) -> str:
    """A key as an error may show it: a name as it is, anything else (a line of some other file) not at all."""
    return repr(key) if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", key) else "a key"


def _read_yaml(text: str, source: str) -> Any:
    """Parse YAML; an error is one line naming `source`, the line and the column, and no text of the file."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no Python objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = (exc.problem or "unreadable").splitlines()[0][:120]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({type(exc).__name__})") from None


def override_value(keys: list[str], raw: str, source: str) -> Any:
    """A `--set` value (`source` names it in an error): YAML, except for a key that holds text, where the text is
    taken as typed when YAML would read something else (`prompt.text=a cat: on a mat` is a mapping, `#red` a comment,
    `12:30` the number 750): a shell already quoted it once, and a second quoting for YAML is what nobody writes.
    Quoted text, and a null (`null`, `~`) for a key that may be unset, are read as YAML reads them."""
    value = raw.strip()
    if not value:
        return None
    if not _holds_text(keys):
        return _read_yaml(raw, source)
    try:
        parsed = _read_yaml(raw, source)
    except ConfigError:
        return value
    return parsed if isinstance(parsed, str) or (parsed is None and value in YAML_NULLS) else value


def _holds_text(keys: list[str]) -> bool:
    """Whether the config key at `keys` (a section path, then the key) is a string field (optional or not)."""
    cls: Any = LoomConfig
    for key in keys:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return False
        hint = typing.get_type_hints(cls).get(key)
        if hint is None:
            return False
        cls = hint
    inner = {a for a in typing.get_args(cls) if a is not type(None)} if typing.get_args(cls) else {cls}
    return inner == {str}


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a config file is a UTF-8 YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None


def _load_source(name_or_path: str | Path | None) -> tuple[dict, str]:
    if name_or_path is None:
        name_or_path = DEFAULT_PRESET
    path = Path(name_or_path).expanduser()
    # a shipped preset's bare name is that preset, whatever the working folder holds (./name is the file)
    bare_preset = isinstance(name_or_path, str) and name_or_path in list_presets()
    if not bare_preset and (path.suffix.lower() in (".yaml", ".yml") or path.exists()):
        if path.is_dir():
            raise ConfigError(f"{path}: is a folder; expected a YAML config file or a preset name")
        if not path.is_file():  # `-c default.yaml` for the preset is a slip to name, not only a missing file
            preset = f"; did you mean the preset {path.stem!r} (-c {path.stem})?" if path.stem in list_presets() else ""
            raise ConfigError(f"{path}: config file not found{preset}")
        source, text = str(path), _read_text(path)
    else:
        name = str(name_or_path)
        if name not in list_presets():
            raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, list_presets())}; available: "
                              f"{', '.join(list_presets())}")
        source = f"preset {name}"
        text = resources.files(PRESET_PACKAGE).joinpath(f"{name}.yaml").read_text()
    data = _read_yaml(text, source)
    if data is None:
        raise ConfigError(f"{source}: the file is empty; expected a mapping such as 'model: {{preset: tiny}}'")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    strange = [k for k in data if _name(k) == "a key"]
    if strange:  # not a config file at all (a key like 'root:$6$...'): say so without showing it
        raise ConfigError(f"{source}: the top level holds a key that is not a name (is this a Loom config "
                          f"file?); allowed keys here: {', '.join(f.name for f in dataclasses.fields(LoomConfig))}")
    return data, source


def overridden_source(name_or_path: str | Path | None, overrides: list[str] | tuple[str, ...],
                       sources: list[str] | None = None, label: str = "--set overrides") -> tuple[dict, str]:
    data, source = _load_source(name_or_path)
    for number, text in enumerate(overrides):
        keys, raw = parse_override(text)
        apply_override(data, keys, override_value(keys, raw, sources[number] if sources else f"--set {text}"))
    if overrides:
        source += f" (with {label})"
    return data, source


def model_family(name_or_path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The model family a config names, read before it is built: a command can then refuse an option of the
    other family by the option's own name (the built config names only the key it set, and lets pass a value
    equal to the key's default). A family that is not allowed is the build's to say."""
    return _family(overridden_source(name_or_path, overrides)[0])


def _family(data: dict) -> str:
    model = data.get("model")
    family = model.get("family") if isinstance(model, dict) else None
    return family if isinstance(family, str) else ModelConfig().family


def check_prompt_text(data: dict, source: str) -> None:
    """prompt.text as a host's prompt is checked, with what the model family takes: the prompt section is built
    without the family, and a blank `--set prompt.text=" "` (read as null) would be said as a value of the wrong
    type. A number or a list is the build's to say, as is a family not allowed."""
    prompt, family = data.get("prompt"), _family(data)
    if not isinstance(prompt, dict) or "text" not in prompt or family not in live.PROMPT_TAKES:
        return
    if prompt["text"] is None or isinstance(prompt["text"], str):
        try:
            live.check_prompt_request(prompt["text"], family=family)
        except ValueError as exc:
            raise ConfigError(f"{source}: prompt.text: {exc}") from None


def load_config(name_or_path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> LoomConfig:
    """Load a preset name or a YAML file, apply `key.sub=value` overrides, validate everything; weights the
    run needs and the user did not give are looked up in what `loom pull` fetched (engine.models.weights)."""
    data, source = overridden_source(name_or_path, overrides)
    check_prompt_text(data, source)
    from loom_live.engine.models.weights import fill_pulled_weights

    return fill_pulled_weights(build(LoomConfig, data, source=source))
