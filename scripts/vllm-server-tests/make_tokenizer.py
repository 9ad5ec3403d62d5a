"""Extract the default model's tokenizer (SmolLM2-135M-Instruct, from the GGUF nanoserve embeds) into an HF
tokenizer dir, so tests calling get_tokenizer(MODEL_NAME) can run offline. Runs under /work/main/.venv."""
import json
import sys
from pathlib import Path

import torch

from nanoserve.model.gguf import load_gguf
from nanoserve.model.loader import default_model_path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
ckpt = load_gguf(default_model_path(), dtype=torch.float32, keep_blocks=True)
ckpt.tokenizer.save(str(out / "tokenizer.json"))
tmpl = ckpt.chat_template
cfg = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": ckpt.bos_token, "eos_token": ckpt.eos_token,
    "add_bos_token": bool(ckpt.add_bos_token),
    "model_max_length": 8192,
    "chat_template": tmpl if isinstance(tmpl, str) else (tmpl or {}).get("default"),
}
(out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
(out / "special_tokens_map.json").write_text(json.dumps({"bos_token": ckpt.bos_token, "eos_token": ckpt.eos_token}))
print("wrote", out, cfg["bos_token"], cfg["eos_token"], ckpt.tokenizer.get_vocab_size())
