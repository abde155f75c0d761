"""Training Loom's embedded default model with Loom's own modules (docs/embedded-model.md).

styles: the procedural target styles; data: styled pairs in one file (CPU); text_table: the
shipped prompt -> style table (build time); recipe: the VAE and the streamed DiT (one GPU);
evaluate: the model card's metrics and the README picture (CPU); cli: `loom train ...`.
"""
