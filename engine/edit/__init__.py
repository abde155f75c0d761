"""The edit family: an MLLM-conditioned edit UNet streamed in B-frame batches on two CUDA streams.

unet (the denoiser: DreamLite's UNet), unet_config (its architecture from a diffusers config.json),
lllite (the temporal adapter), encoder (Qwen3-VL conditioning), vae (tiny
autoencoder), schedule (flow-matching Euler), flow (the adapter's warped condition), checkpoint
(strict loading), loading (models from the config), params (live parameters), session (the
stream, the `EngineSession` the server drives).
"""
