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

# HEAVY's vision tower feeding an LLM through a projector, with an LM loss (a sum over tokens): micro-batches leave
# the loss as it is, so --spindle-micro-batches auto may choose them (a contrastive loss keeps one, see HEAVY).
HEAVY_LM = {
    "name": "heavy-lm",
    "modules": {
        "vision": {k: v for k, v in HEAVY["modules"]["vision"].items() if k != "embed_dim"},
        "vis_proj": {"kind": "projector", "input_size": 1024, "hidden_size": 512},
        "llm": {"kind": "llm", "num_layers": 4, "hidden_size": 512, "num_heads": 8, "ffn_hidden_size": 1408,
                "frontend": {"type": "text", "vocab_size": 32000}},
    },
    "tasks": [{"name": "caption", "batch_size": 64, "tokens": {"vision": 257, "vis_proj": 257, "llm": 320},
               "flows": [["vision", "vis_proj"], ["vis_proj", "llm"]], "loss": {"kind": "lm", "module": "llm"}}],
}
