"""`appliance run`: start the engine core, then serve HTTP until SIGTERM.

The core is started (model loaded, one warm-up generation done) before the
listener opens, so a server that accepts connections is ready. SIGTERM
stops admitting (``/ready`` turns 503), lets in-flight requests finish for
up to ``server.shutdown_timeout_s`` (then aborts them), stops the core and
exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from appliance.config.plan import make_plan, max_model_len

log = logging.getLogger("appliance.server")


def serve_forever(resolved: Any, selection: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return asyncio.run(_serve(resolved, selection))


async def _serve(resolved: Any, selection: Any) -> int:
    import uvicorn
    from transformers import AutoTokenizer

    from appliance.models.loader import resolve_model_folder
    from appliance.server.app import ServerState, create_app
    from appliance.server.client import EngineClient, EngineDeadError
    from appliance.server.metrics import Metrics

    cfg = resolved.cfg
    folder = resolve_model_folder(cfg.model)  # prepare (convert/generate) once, before the core starts
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model_name = cfg.server.served_model_name or cfg.model.name
    metrics = Metrics(model_name, cfg.profile, resolved.hash)
    client = EngineClient(resolved, selection, on_stats=metrics.on_core_stats)
    try:
        await client.start()
    except EngineDeadError as e:
        print(f"appliance run: error: {e}", file=sys.stderr)
        await client.shutdown()
        return 1
    state = ServerState(resolved=resolved, client=client, tokenizer=tokenizer, metrics=metrics, model_name=model_name,
                        max_model_len=max_model_len(cfg), api_key=cfg.server.api_key,
                        max_queue_len=cfg.server.max_queue_len)
    app = create_app(state)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            state.shutting_down = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after serving, which would kill us
            # before the core is stopped; a handled SIGTERM exits 0 instead.
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level="warning",
                            timeout_graceful_shutdown=int(cfg.server.shutdown_timeout_s), lifespan="off")
    server = Server(config)
    plan = make_plan(cfg)
    log.info("profile %s (config %s), model %s, backend %s, dtype %s", cfg.profile, resolved.hash, model_name,
             selection.chosen, plan.dtype)
    log.info("KV cache: %d blocks x %d tokens, max_model_len %d", client.ready_info["num_kv_blocks"],
             client.ready_info["block_size"], state.max_model_len)
    log.info("serving on http://%s:%d/v1", cfg.server.host, cfg.server.port)
    try:
        await server.serve()
    finally:
        state.shutting_down = True
        await client.shutdown(timeout_s=cfg.server.shutdown_timeout_s)
    log.info("shut down cleanly")
    return 0
