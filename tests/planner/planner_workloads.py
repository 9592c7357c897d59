"""Small workloads shared by the planner tests."""

# One heavy vision tower and a light text tower in one contrastive task: its activations bind memory first.
HEAVY = {
    "name": "heavy",
    "modules": {
        "vision": {"kind": "encoder", "num_layers": 8, "hidden_size": 1024, "num_heads": 16,
                   "ffn_hidden_size": 4096, "embed_dim": 256,
                   "frontend": {"type": "patch", "image_size": 224, "patch_size": 14, "in_channels": 3}},
        "text": {"kind": "encoder", "num_layers": 4, "hidden_size": 512, "num_heads": 8, "ffn_hidden_size": 2048,
                 "embed_dim": 256, "frontend": {"type": "text", "vocab_size": 32000}},
    },
    "tasks": [{"name": "vt", "batch_size": 64, "tokens": {"vision": 257, "text": 77},
               "loss": {"kind": "contrastive", "modules": ["vision", "text"]}}],
}
