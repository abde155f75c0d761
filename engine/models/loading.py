"""Building the models a run needs: from the user's checkpoints, or the embedded default.

The tiny presets come with fixed seeded weights, so Loom runs end to end out of the box (on a
CPU too) without any download. A real-size preset without a checkpoint is refused unless the
run explicitly asks for random weights (benchmarks: speed does not depend on weight values), so a
forgotten path never silently produces noise on stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom_live.engine.config import LoomConfig, VAEConfig
from loom_live.engine.graphs.compile_cache import cache_root, set_kernel_autotuning
from loom_live.engine.graphs.saved_compiles import compiled_folder
from loom_live.engine.models.checkpoint_io import CheckpointError
from loom_live.engine.models.fp8_linear import check_fp8_device, convert_dit_to_fp8
from loom_live.engine.models.lora import LoraMerger, read_lora
from loom_live.engine.models.taehv import TinyVAE
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.models.wan_dit_ops import BlockOps
from loom_live.engine.models.wan_vace import VACE_PRESETS, WanVaceDiT
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE, WanVAEConfig

EMBEDDED_PRESETS = ("tiny", "tiny-vace")
# vae.thin_convs -> (WanVAE.use_thin_convs's kinds, stack_upto): `wide` also stacks the full-resolution convs
THIN_CHOICES = {"none": ((), 0), "taps": (("taps",), 0), "stack": (("stack",), 0), "both": (("stack", "taps"), 0),
                "wide": (("stack", "taps"), 96)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModels:
    dit: WanDiT
    encoder: Any  # WanVAE, TinyVAE, or a TiledVAE around one: encode_stream / new_stream_state
    decoder: Any  # WanVAE, TinyVAE, or a TiledVAE around one: decode_stream / new_stream_state
    device: torch.device
    dtype: torch.dtype
    lora: LoraMerger  # the DiT's merged style LoRAs (none loaded: a no-op owner)
    load_s: dict[str, float] = field(default_factory=dict)  # seconds per part of the load (start-up log)


def resolve_device(setting: str, key: str = "model.device") -> torch.device:
    """The device of a checked setting (auto, cpu, cuda or cuda:N); one this machine lacks is refused naming
    `key` (the config key, or a command's option) before anything loads onto it."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"{key}: {setting!r} asked for CUDA but no CUDA GPU is available; use 'auto' or 'cpu'")
    visible = torch.cuda.device_count()
    if (device.index or 0) >= visible:  # else the model load would fail on torch's "invalid device ordinal"
        raise ValueError(f"{key}: {setting!r} names a GPU that is not here ({visible} visible); allowed: "
                         f"auto, cpu, cuda or cuda:0..cuda:{visible - 1}")
    return device


def resolve_dtype(setting: str, device: torch.device, cpu_bfloat16: bool = False) -> torch.dtype:
    """The compute dtype; `auto` is bfloat16 on CUDA and float32 on a CPU, except that a model checked
    to restyle the same in bfloat16 (`cpu_bfloat16`) gets it on a CPU that multiplies it in hardware."""
    if setting == "auto":
        if device.type == "cuda" or (cpu_bfloat16 and native_cpu_bfloat16()):
            return torch.bfloat16
        return torch.float32
    return DTYPES[setting]


def native_cpu_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (AMX or AVX512-BF16). There bfloat16 runs the
    embedded model well faster than float32; elsewhere it is emulated and slower."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _seeded(build, seed: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build a module with weights drawn from a fixed seed, without touching the global RNG."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        with torch.device(device):
            module = build()
    return module.to(dtype=dtype).eval()


def to_channels_last(module: nn.Module) -> None:
    """Channels-last weights: cuDNN's 3D convolutions of the Wan VAE are faster in that layout
    (figures in docs/performance.md)."""
    for p in module.parameters():
        if p.dim() == 5:
            p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
        elif p.dim() == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)


def _drop_blocks(dit: WanDiT, keep: range | None) -> None:
    """A pipeline rank holds only its blocks: the others go to the meta device. The LoRA merger
    and the block moves rely on it (a block a rank holds is its own to merge; one on meta arrives
    by a move and is merged then)."""
    for i in range(len(dit.blocks)) if keep is not None else ():
        if i not in keep:
            dit.blocks[i].to("meta")


def _dit_architecture(preset: str) -> tuple[type[WanDiT], Any]:
    """The DiT class and config of a model preset (a VACE preset's or the plain DiT's)."""
    return (WanVaceDiT, VACE_PRESETS[preset]) if preset in VACE_PRESETS else (WanDiT, DIT_PRESETS.get(preset))


def check_weight_files(cfg: LoomConfig) -> None:
    """Read each weight file the run names for its format, keys and shapes only (on the meta device: no
    weights are read, the models take no memory), and raise CheckpointError naming the file and what is
    wrong; so a file that is not the weights a model needs is refused before any engine starts, instead
    of failing the engine's build after a host waited for it."""
    try:
        _check_weight_files(cfg)
    except OSError as exc:  # a file or folder this user may not read: said in one line, not as a traceback
        raise CheckpointError(f"{exc.filename or exc}: cannot be read ({exc.strerror or type(exc).__name__})") from None


def _check_weight_files(cfg: LoomConfig) -> None:
    mc, vc = cfg.model, cfg.vae
    if mc.family == "edit":
        from loom_live.engine.edit.file_check import check_edit_files

        check_edit_files(cfg)
    if mc.family != "wan":
        return
    dit_class, dit_cfg = _dit_architecture(mc.preset)
    if mc.checkpoint and mc.preset == "embedded":  # a `loom train` file: its DiT and VAE together
        from loom_live.engine.models.embedded import check_embedded_file

        check_embedded_file(mc.checkpoint)
    elif mc.checkpoint:
        dit_class.from_checkpoint(mc.checkpoint, dit_cfg, device="meta")
    if cfg.lora:  # each a LoRA in a layout read_lora knows, every update the shape of a layer of this DiT
        with torch.device("meta"):
            dit = dit_class(dit_cfg)
        for entry in cfg.lora:
            if not Path(entry.path).expanduser().exists():  # the file's own check names no key or option
                raise CheckpointError(f"lora (--lora): {entry.path}: no such file or directory")
            read_lora(entry.path, dit, entry.key, meta=True)
    if vc.checkpoint and "wan" in (vc.encoder, vc.decoder):
        vae_cfg = replace(VAE_PRESETS[vc.preset], normalize_on_encode=vc.normalize_on_encode,
                          denormalize_on_decode=vc.denormalize_on_decode)
        WanVAE.from_checkpoint(vc.checkpoint, vae_cfg, device="meta")
    if vc.taehv_checkpoint and "taehv" in (vc.encoder, vc.decoder):
        TinyVAE.from_checkpoint(vc.taehv_checkpoint, device="meta")
    if cfg.prompt.encoder == "file" and cfg.prompt.path:  # small: read whole, as the session will
        from loom_live.engine.stream.prompts import FileTextEncoder

        FileTextEncoder(cfg.prompt.path)
    if cfg.prompt.encoder == "umt5" and cfg.prompt.path:  # its files are there (11 GB: not read here)
        from loom_live.engine.stream.prompts import umt5_folders

        umt5_folders(cfg.prompt.path)


def load_models(cfg: LoomConfig, dit_blocks: range | None = None) -> LoadedModels:
    """The models of a run; with `dit_blocks` only those DiT blocks get weights (a pipeline rank):
    read from the checkpoint alone, or, for seeded and embedded weights, built whole and the rest dropped."""
    device = resolve_device(cfg.model.device)
    clock = _Laps(device)
    # The embedded model's held-out metrics are the same in bfloat16 (docs/embedded-model.md).
    dtype = resolve_dtype(cfg.model.dtype, device, cpu_bfloat16=cfg.model.preset == "embedded")
    mc, vc = cfg.model, cfg.vae
    if mc.fp8_linear:  # before any weight is read
        check_fp8_device(device)
    dit_class, dit_cfg = _dit_architecture(mc.preset)
    clock.lap("setup")  # the device and dtype resolved
    embedded = mc.preset == "embedded"
    if embedded:  # the trained default: its DiT and VAE ship together, in the package or a training run's file
        from loom_live.engine.models.embedded import load_embedded

        if vc.encoder != "taehv" or vc.decoder != "taehv" or vc.taehv_checkpoint:
            raise ValueError("model.preset: 'embedded' comes with its own VAE; leave vae.encoder and vae.decoder "
                             "at taehv and vae.taehv_checkpoint empty")
        dit, embedded_vae, _ = load_embedded(device, dtype, mc.checkpoint or None)
        _drop_blocks(dit, dit_blocks)
    elif mc.checkpoint:
        dit = dit_class.from_checkpoint(mc.checkpoint, dit_cfg, device=device, dtype=dtype, blocks=dit_blocks).eval()
    elif mc.preset in EMBEDDED_PRESETS or mc.random_weights:
        dit = _seeded(lambda: dit_class(dit_cfg), mc.seed, device, dtype)
        _drop_blocks(dit, dit_blocks)  # same seeded values as one GPU for the blocks kept
    else:
        raise ValueError(f"model.checkpoint: preset {mc.preset!r} needs weights; run `loom pull {mc.preset}` or "
                         "give model.checkpoint=PATH (or model.random_weights=true for a benchmark)")
    clock.lap("dit")  # built, and its weights read or drawn
    wan = None
    if "wan" in (vc.encoder, vc.decoder):
        vae_dtype = dtype if vc.dtype == "auto" else DTYPES[vc.dtype]
        if vc.checkpoint:
            wan = WanVAE.from_checkpoint(vc.checkpoint, _wan_vae_config(vc), device=device, dtype=vae_dtype).eval()
        elif vc.preset in EMBEDDED_PRESETS or vc.random_weights:
            wan = _seeded(lambda: WanVAE(_wan_vae_config(vc)), mc.seed + 1, device, vae_dtype)
        else:
            raise ValueError(f"vae.checkpoint: preset {vc.preset!r} needs weights; run `loom pull {mc.preset}` "
                             "or give vae.checkpoint=PATH (or vae.random_weights=true for a benchmark)")
        wan.use_upsample(vc.upsample)  # on every device: the same result with fewer multiply-adds
        if vae_dtype != dtype:
            wan.use_io_dtype(dtype)
    tiny = None
    if "taehv" in (vc.encoder, vc.decoder):
        if embedded:
            tiny = embedded_vae
        elif vc.taehv_checkpoint:
            tiny = TinyVAE.from_checkpoint(vc.taehv_checkpoint, device=device, dtype=dtype).eval()
        elif vc.random_weights:
            tiny = _seeded(TinyVAE, mc.seed + 2, device, dtype)
        else:
            raise ValueError("vae.taehv_checkpoint: the taehv encoder/decoder needs taew2_1.pth "
                             "(or vae.random_weights=true for a benchmark)")
    clock.lap("vae")
    if mc.fuse_qkv and device.type == "cuda":  # before the LoRA merger takes the weights
        dit.fuse_projections()
    lora = LoraMerger(dit, keep_device="cpu" if cfg.memory.low_vram else None, parts=cfg.stream.lora_merge_parts)
    for entry in cfg.lora:  # merged before the weights are compiled or captured
        lora.add(read_lora(entry.path, dit, entry.key), entry.scale)
    lora.capture()  # a live scale change replays one CUDA graph (CUDA only)
    clock.lap("lora")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed chunk shapes: autotuned conv kernels pay off
        if wan is not None and wan.dtype == torch.float16:
            # Every algorithm cuDNN has, not the ten its heuristics rank first: only the whole list holds its
            # float16 kernels with 96-wide column tiles, the width of the VAE's full-resolution convolutions.
            torch.backends.cudnn.benchmark_limit = 0
        set_kernel_autotuning(mc.autotune_kernels)  # keys the compile caches: pipeline ranks load here too
        # where compiled steps are kept whole (its name hashes the engine's sources)
        saving = mc.saved_block_ops != "none" or vc.saved_steps != "none"
        saved = compiled_folder(cache_root(), device) if saving else None
        if mc.fuse_elementwise:
            dit.fuse_elementwise(BlockOps.compiled(gelu_epilogue=mc.gelu_epilogue,
                                                   attention_splits=mc.attention_splits,
                                                   masked_sink_merge=mc.masked_sink_merge,
                                                   saved=saved if mc.saved_block_ops != "none" else None,
                                                   build_saved=mc.saved_block_ops == "build"))
        elif mc.attention_splits > 1:
            dit.fuse_elementwise(BlockOps.eager(attention_splits=mc.attention_splits))
        clock.lap("block_ops")  # the first compiled function imports torch's compiler
        if wan is not None:
            _lay_out_wan_vae(wan, vc, saved)
        clock.lap("vae_ops")
    if mc.fp8_linear:  # after loading (the checkpoint holds the full-precision weights) and the block ops
        convert_dit_to_fp8(dit, compiled=mc.fuse_elementwise, kernels=mc.fp8_quantize)
        clock.lap("fp8")
    encoder = wan if vc.encoder == "wan" else tiny
    decoder = wan if vc.decoder == "wan" else tiny
    mem = cfg.memory
    if mem.low_vram:  # activations bounded by the tile area instead of the frame's
        from loom_live.engine.models.vae_tiling import TiledVAE

        encoder = TiledVAE(encoder, tile_latents=mem.vae_tile_latents, overlap_latents=mem.vae_tile_overlap)
        decoder = TiledVAE(decoder, tile_latents=mem.vae_tile_latents, overlap_latents=mem.vae_tile_overlap)
    for m in (dit, wan, tiny):
        if m is not None:
            m.requires_grad_(False)
    clock.lap("prepare")  # the rest: VAE wrappers, gradients off
    return LoadedModels(dit, encoder, decoder, device, dtype, lora, clock.laps)


def _wan_vae_config(vc: VAEConfig) -> WanVAEConfig:
    return replace(VAE_PRESETS[vc.preset], normalize_on_encode=vc.normalize_on_encode,
                   denormalize_on_decode=vc.denormalize_on_decode)


def _lay_out_wan_vae(wan: WanVAE, vc: VAEConfig, saved: Path | None) -> None:
    """The Wan VAE's GPU forms, in the order they must come (its compiled steps last, with their `saved` folder
    where they are kept)."""
    wan.use_thin_convs(*THIN_CHOICES[vc.thin_convs])
    wan.use_attention(vc.attention)
    wan.use_channels_last(vc.channels_last)
    if vc.compile_step:  # includes what fuse_norms does
        wan.compile_step(tune=vc.tune_kernels, saved=saved if vc.saved_steps != "none" else None,
                         build_saved=vc.saved_steps == "build")
    elif vc.fuse_norms:
        wan.fuse_norms()


class _Laps:
    """Seconds between successive `lap` calls, by name. On a GPU each lap first waits for the device, so
    work queued asynchronously (weights drawn on the device, layout copies) counts where it was queued."""

    def __init__(self, device: torch.device) -> None:
        self.laps: dict[str, float] = {}
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None
        self._device = device
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self._sync is not None:
            self._sync(self._device)
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now
