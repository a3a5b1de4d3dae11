"""A distilled student's decode speed in llama.cpp against its teacher's, both in the
teacher's quantization: the run's final/ exported as a GGUF (`toy export --format gguf`,
f32), quantized by llama.cpp itself (llama-cpp-python's llama_model_quantize) to the
teacher's file type, then bench/generate.py's llama.cpp child on each (the same prompt,
greedy, 2 threads, each in its own process), alternating, --repeats times.

    python bench/distill_decode.py --teacher data/smollm2-135m.gguf --run runs/<distill-id> \\
        [--tokens 128] [--repeats 3]

Prints one JSON line a measurement and the medians' ratio; the CPU kind is named.
--ftype 7 requantizes both to Q8_0: a SmolLM2 student shrunk to 15 blocks and distilled
for 150 steps came out of llama.cpp's Q4_1 quantization as nonsense (Q8_0 and Q4_0 kept
its text; docs/results.md says what breaks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def quantize(src: Path, out: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # --ftype: the teacher's own blocks requantized too
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc})")


def decode(model: Path, tokens: int) -> dict:
    argv = [sys.executable, str(HERE / "generate.py"), "--impl", "llamacpp", "--model", str(model),
            "--tokens", str(tokens)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--ftype",
        type=int,
        help="llama.cpp file type for both (7: Q8_0), the teacher requantized from its own "
        "blocks; default: the teacher's own type, the teacher as it is",
    )
    a = ap.parse_args()
    from toy.formats.gguf_header import read_gguf_header
    from toy.train.device import cpu_kind

    ftype = int(read_gguf_header(a.teacher).metadata["general.file_type"])
    d = Path(tempfile.mkdtemp(prefix="distill-decode-"))
    teacher = a.teacher
    if a.ftype is not None and a.ftype != ftype:
        ftype, teacher = a.ftype, d / "teacher.gguf"
        quantize(a.teacher, teacher, ftype)
    f32 = d / "student-f32.gguf"
    r = subprocess.run([sys.executable, "-m", "toy", "export", str(a.run), "--format", "gguf",
                        "--out", str(f32)], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        sys.exit(r.stderr)
    student = d / "student.gguf"
    quantize(f32, student, ftype)
    rates: dict[str, list[float]] = {"teacher": [], "student": []}
    for _ in range(a.repeats):
        for name, path in (("teacher", teacher), ("student", student)):
            res = decode(path, a.tokens)
            rates[name].append(res["tokens_per_s"])
            print(json.dumps({"model": name, "file_type": ftype, **res}), flush=True)
    t, s = statistics.median(rates["teacher"]), statistics.median(rates["student"])
    print(
        json.dumps(
            {"cpu": cpu_kind(), "teacher_tok_s": t, "student_tok_s": s, "ratio": round(s / t, 2)}
        )
    )


if __name__ == "__main__":
    main()
