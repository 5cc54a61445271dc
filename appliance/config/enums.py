"""The closed sets of values the schema's keys take (``config/schema.py``):
a value outside one fails at compose time with the key's path."""

from enum import StrEnum


class DType(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class QuantMethod(StrEnum):
    none = "none"
    fp8 = "fp8"
    gguf = "gguf"
    awq = "awq"
    gptq = "gptq"
    int8_wo = "int8_wo"
    w8a8_int8 = "w8a8_int8"
    int4_wo = "int4_wo"
    mxfp4 = "mxfp4"


class KVCacheDType(StrEnum):
    auto = "auto"
    bfloat16 = "bfloat16"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"


class HashAlgo(StrEnum):
    sha256 = "sha256"
    sha256_cbor = "sha256_cbor"
    builtin = "builtin"


class Policy(StrEnum):
    fcfs = "fcfs"
    priority = "priority"


class ParallelExecutor(StrEnum):
    auto = "auto"  # uni for one rank, mp for more
    uni = "uni"  # the model in the engine's own process (one rank)
    mp = "mp"  # a worker process per rank on this host
    ray = "ray"  # a Ray actor per rank, on a local Ray instance or a cluster (parallel.ray_address)


class CpuCollectives(StrEnum):
    shm = "shm"  # a shared-memory segment between the ranks of one host
    gloo = "gloo"  # torch.distributed's gloo backend


class DeviceKind(StrEnum):
    cpu = "cpu"
    cuda = "cuda"
    rocm = "rocm"


class SpecMethod(StrEnum):
    off = "off"
    ngram = "ngram"
    draft_model = "draft_model"


class StructuredBackend(StrEnum):
    xgrammar = "xgrammar"
    guidance = "guidance"  # vLLM's other backends: refused until built
    outlines = "outlines"


class ToolParser(StrEnum):
    auto = "auto"  # the model's own: harmony's channels on a harmony model, hermes otherwise
    hermes = "hermes"
    llama3_json = "llama3_json"


class ReasoningParserName(StrEnum):
    deepseek_r1 = "deepseek_r1"
    qwen3 = "qwen3"


class Fallback(StrEnum):
    deny = "deny"
    allow = "allow"


class RopeScalingType(StrEnum):
    none = "none"
    llama3 = "llama3"
    linear = "linear"
    yarn = "yarn"
    longrope = "longrope"
