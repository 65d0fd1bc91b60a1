"""Rewrite a per-expert qwen3_moe / mixtral checkpoint (e.g. `moestream synth qwen3_moe DIR --preset small`) in
transformers' fused layout: per layer `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
`mlp.experts.down_proj` [E, H, I]. An expert's parts then lie in two tensors far apart (two reads per expert),
the layout bench/ab_pack.py compares with its packed copy. Streams one layer at a time.
    python bench/fuse_experts.py SRC DST
"""
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from moestream.weights.index import CheckpointIndex

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
for f in src.iterdir():
    if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
        shutil.copyfile(f, dst / f.name)
index = CheckpointIndex.open(src)
expert_re = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
layers: dict[str, dict[int, dict[str, str]]] = {}
dense = []
for name in index.names():
    m = expert_re.match(name)
    if m:
        layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = name
    else:
        dense.append(name)
weight_map = {}
save_file({n: index.load(n).clone() for n in dense}, str(dst / "model-dense.safetensors"))
weight_map.update({n: "model-dense.safetensors" for n in dense})
for i, (prefix, experts) in enumerate(sorted(layers.items())):
    order = [experts[e] for e in sorted(experts)]
    gate_up = torch.stack([torch.cat([index.load(p["gate"]), index.load(p["up"])]) for p in order])
    down = torch.stack([index.load(p["down"]) for p in order])
    fname = f"model-experts-{i:03d}.safetensors"
    save_file({prefix + "gate_up_proj": gate_up, prefix + "down_proj": down}, str(dst / fname))
    weight_map.update({prefix + "gate_up_proj": fname, prefix + "down_proj": fname})
(dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
print(f"wrote {dst}: {len(layers)} fused expert layers")
