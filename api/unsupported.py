"""What a request to a route Twinkle does not have was: a Tinker SDK call Twinkle does not support, or unknown.

A bare "404 Not Found" leaves a Tinker user guessing whether their URL is wrong or the feature is missing;
this names the SDK call and what to do instead. Patterns are matched against the end of the path, so they
hold for any configured `route_prefix`.
"""

from __future__ import annotations

import re

# (HTTP methods, path suffix pattern, the SDK call, what to do instead)
SDK_CALLS: list[tuple[frozenset[str], re.Pattern[str], str, str]] = [
    (frozenset({"POST"}), re.compile(r"/auth/token$"), "JWT authentication (ServiceClient with pjwt_auth_enabled)",
     "Authenticate with the API key itself (X-API-Key or Authorization: Bearer)."),
    (frozenset({"GET", "DELETE"}), re.compile(r"/auth/apikey/me$"), "`tinker auth login` / `tinker auth logout`",
     "Keys are managed by the operator (twinkle-server keys); set TINKER_API_KEY directly."),
    (frozenset({"GET"}), re.compile(r"/audit$"), "RestClient.get_audit_log / AdminClient.get_audit_log",
     "Twinkle keeps no audit log; ask the operator for the API's access log."),
    (frozenset({"GET"}), re.compile(r"/billing/usage/events$"), "get_billing_usage",
     "Twinkle does not bill usage."),
    (frozenset({"GET"}), re.compile(r"/billing/usage/checkpoints/current$"),
     "get_current_checkpoint_storage_usage", "Sum size_bytes over RestClient.list_user_checkpoints instead."),
    (frozenset({"POST"}), re.compile(r"/cancel_future$"), "sample cancellation (cancel_future)",
     "Twinkle's dynamic config leaves sample_cancel_enabled off; let the sample finish."),
    (frozenset({"POST"}), re.compile(r"/create_custom_loss$"), "server-side custom losses (create_custom_loss)",
     "Use forward_backward_custom, which computes the custom loss on the client."),
    (frozenset({"POST"}), re.compile(r"/join_sampling_session$"), "join_sampling_session",
     "Create a sampling client per process (create_sampling_client)."),
    (frozenset({"POST"}), re.compile(r"/retrieve_futures$"), "batched retrieve_futures",
     "Leave sample_use_retrieve_futures off in the client config (Twinkle's default)."),
    (frozenset({"POST"}), re.compile(r"/sessions/search$"), "RestClient.search_sessions",
     "Use RestClient.list_sessions."),
    (frozenset({"PUT"}), re.compile(r"/sessions/[^/]+/project$"), "RestClient.assign_session_project",
     "Twinkle has no projects; sessions belong to the API key."),
    (frozenset({"GET"}), re.compile(r"/sessions/[^/]+/trace_export$"), "RestClient.export_session_trace",
     "Use the server's OpenTelemetry traces (see the README's telemetry section)."),
]


def describe_missing_route(method: str, path: str) -> tuple[str, str]:
    """(code, message) for a request no route matched."""
    for methods, pattern, call, instead in SDK_CALLS:
        if method.upper() in methods and pattern.search(path):
            return "unsupported", (f"{method} {path} is the Tinker SDK call {call}, which Twinkle does not "
                                   f"support. {instead}")
    return "unknown_route", (f"{method} {path} is not a Twinkle or Tinker SDK route. Check the URL and the "
                             "server's route prefix; GET /docs lists every route.")
