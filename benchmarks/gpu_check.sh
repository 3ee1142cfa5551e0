#!/usr/bin/env bash
# GPU check: the CUDA tests and two one-GPU training runs, with tokens/s and MFU, in one go.
#
#   OUT=gpu-out bash benchmarks/gpu_check.sh     # from the repository root, on a GPU machine
#
# Nothing is downloaded: the Hugging Face model is a Llama made from a config, its tokenizer
# trained on the standard library's sources (docs/hf.md's make_tiny, at a larger size).
# Writes gpu.txt, test_cuda.txt, medium.txt, hf.txt and mfu.txt under $OUT.
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the training runs only
    python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.txt"
fi

# the GPT `medium` preset (86 M parameters) on one GPU, bf16 (one process: one stage)
python3 -m pipetrain train --nproc 1 --device cuda --preset medium --precision bf16 \
    --seq-len 512 --batch-size 64 --microbatches 4 --steps 60 --eval-every 0 \
    --sample-tokens 0 --no-progress --out "$WORK/medium" 2>&1 | tee "$OUT/medium.txt"

# a Llama of 8 layers x 1024 saved by transformers, trained with --hf on one GPU, bf16
(cd "$WORK" && python3 - <<'EOF'
import pathlib, sysconfig
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
text = [p.read_text() for p in sorted(stdlib.glob("*.py"))[:40]]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(text, trainers.BpeTrainer(
    vocab_size=8192, special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2816,
                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                        max_position_embeddings=1024)
tf.AutoModelForCausalLM.from_config(config).save_pretrained("llama-1024")
tok.save_pretrained("llama-1024")
EOF
)
python3 -m pipetrain train --hf "$WORK/llama-1024" --nproc 1 --device cuda --precision bf16 \
    --seq-len 512 --batch-size 64 --microbatches 4 --steps 40 --eval-every 0 \
    --sample-tokens 0 --no-progress --token-cache "$WORK/tokens" --out "$WORK/hf" 2>&1 \
    | tee "$OUT/hf.txt"

# model FLOPs utilisation: 6 x parameters x tokens/s (plus attention's 12 x layers x width x
# sequence per token), over the GPU's dense bf16 peak and over a measured 8192^3 matmul
python3 - "$WORK" <<'EOF' | tee "$OUT/mfu.txt"
import json, sys, time
import torch

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ a
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(10):
    a @ a
torch.cuda.synchronize()
measured = 10 * 2 * 8192 ** 3 / (time.perf_counter() - t)
name = torch.cuda.get_device_name(0)
peak = {"H100": 989e12, "H200": 989e12}.get(next((k for k in ("H100", "H200") if k in name), ""))
runs = {"medium": (12, 768, 512), "hf": (8, 1024, 512)}  # layers, width, sequence
print(f"{name}: measured bf16 matmul {measured / 1e12:.0f} TFLOP/s; spec dense bf16 "
      f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")
for run, (layers, width, seq) in runs.items():
    summary = json.load(open(f"{sys.argv[1]}/{run}/summary.json"))
    params, per_token = summary["params"], 6 * summary["params"] + 12 * layers * width * seq
    median = 64 * seq / summary["step_s"]  # tokens per step / the median step after the first
    for what, tps in (("mean of all steps", summary["tokens_per_s"]), ("median step", median)):
        flops = per_token * tps
        print(f"{run} ({what}): {params:,} parameters, {tps:,.0f} tokens/s, "
              f"{flops / 1e12:.1f} TFLOP/s: MFU {flops / peak if peak else float('nan'):.3f} "
              f"of spec, {flops / measured:.3f} of the measured matmul")
EOF
