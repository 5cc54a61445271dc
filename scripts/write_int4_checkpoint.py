#!/usr/bin/env python3
"""Write a Hugging Face folder as an AWQ (GEMM layout) or GPTQ checkpoint,
quantized round-to-nearest in groups (appliance.models.int4_checkpoints.write_checkpoint).

    python scripts/write_int4_checkpoint.py SRC DST --method awq --group 64
    appliance run model.path=DST           # quantization=awq comes from its config.json
"""

import argparse

from appliance.models.int4_checkpoints import write_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a Hugging Face folder (config.json and unsharded safetensors)")
    p.add_argument("dest", help="the folder to write (must not exist)")
    p.add_argument("--method", choices=["awq", "gptq"], default="awq")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=32)
    a = p.parse_args()
    write_checkpoint(a.source, a.dest, a.method, a.bits, a.group)
    print(f"wrote {a.dest} ({a.method}, {a.bits} bits, groups of {a.group})")


if __name__ == "__main__":
    main()
