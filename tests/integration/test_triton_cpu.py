"""`appliance generate` with attention.backend=triton on a CPU host, the
kernels run by the Triton interpreter (TRITON_INTERPRET=1): greedy output
equal to the default CPU reference backend's."""

ARGS = ["generate", "+profile=cpu", "model=tiny_random", "model.dtype=float32",
        "prompt=The quick brown fox jumps over the lazy dog.", "max_tokens=8", "temperature=0"]


def test_generate_under_the_interpreter_matches_torch_sdpa(cli):
    tri = cli(*ARGS, "attention.backend=triton", env={"TRITON_INTERPRET": "1"}, timeout=120)
    assert tri.returncode == 0, tri.stderr
    ref = cli(*ARGS, "attention.backend=torch_sdpa", env={"TRITON_INTERPRET": "0"}, timeout=120)
    assert ref.returncode == 0, ref.stderr
    assert tri.stdout.strip() and tri.stdout == ref.stdout


def test_generate_without_the_interpreter_says_how_to_run_triton_on_cpu(cli):
    r = cli(*ARGS, "attention.backend=triton", env={"TRITON_INTERPRET": "0"}, timeout=120)
    assert r.returncode == 2
    assert "triton: rejected: device kind cpu not in ['cuda', 'rocm'] (TRITON_INTERPRET=1 runs it on CPU" in r.stderr
