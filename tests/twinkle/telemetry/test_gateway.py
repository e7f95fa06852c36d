"""The API side: route templates as metric labels, and nothing at all when telemetry is off."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass

from twinkle.telemetry.gateway import route_template


@dataclass
class Route:
    path_format: str


def test_route_templates_keep_the_prefix_and_hide_the_parameters() -> None:
    scope = {"route": Route("/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish"),
             "path": "/api/v1/training_runs/s1:train:0/checkpoints/weights/step-3/publish",
             "path_params": {"run_id": "s1:train:0", "checkpoint_id": "weights/step-3"}}
    assert route_template(scope) == "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish"
    assert route_template({"route": Route("/twinkle/encode"), "path": "/v2/twinkle/encode"}) == "/v2/twinkle/encode"
    assert route_template({"path": "/nowhere"}) == "unmatched"


def test_with_telemetry_off_the_api_imports_no_instrumentation_and_its_hooks_do_nothing() -> None:
    code = textwrap.dedent("""
        import sys
        from api.app import create_app
        from twinkle.config import parse_config
        from twinkle.telemetry import link_future, record_rate_limit_rejection, submit_trace
        from twinkle.telemetry.gateway import GatewayMetricsMiddleware
        config = parse_config({"applications": [
            {"name": "m", "route_prefix": "/api/v1/model/x", "import_path": "model",
             "args": {"backend": "mock", "model_id": "/nonexistent/x"}}]})
        app = create_app(config, "redis://127.0.0.1:6379/7")
        assert not [m for m in app.user_middleware if m.cls is GatewayMetricsMiddleware]
        assert submit_trace("r", "forward_backward", "s:train:0", "model.m.0") == ""
        assert record_rate_limit_rejection("m", "requests") is None
        loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.instrumentation",
                        "opentelemetry.exporter", "opentelemetry.sdk.trace")))
        assert not loaded, loaded
        from opentelemetry import trace
        assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
