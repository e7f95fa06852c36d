"""`twinkle-server`: launch the server and inspect its config.

    twinkle-server launch -c cfg.yaml [--namespace NS] [--host H] [--port P] [-v]
                          [--only api | --only worker NAME [--replica I ...] | --only flower]
    twinkle-server stop-ray [--address HOST:PORT | -c cfg.yaml] [--grace S]
    twinkle-server check-config -c cfg.yaml
    twinkle-server print-config -c cfg.yaml [--format yaml|json]
    twinkle-server clear persistence -c cfg.yaml
    twinkle-server build-tiny-model OUT_DIR [--vocab-size N] [--seed S]
    twinkle-server export-merged PATH OUT_DIR [--base-url URL] [--api-key KEY] [--overwrite]
    twinkle-server keys add [--label NAME] [--prefix tw-|tml-] [--tier TIER] [--weight W] | list
                       | set LABEL_OR_HASH_PREFIX [--tier TIER] [--weight W] | revoke LABEL_OR_HASH_PREFIX
                       [--keys-file PATH | -c cfg.yaml]

`-c` defaults to $TWINKLE_SERVER_CONFIG and `--namespace` to $TWINKLE_RAY_NAMESPACE, then to the config's
`ray_namespace`. Exit codes: 0 success, 2 invalid arguments or config, 1 any other Twinkle error.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from twinkle.config import ConfigError, ServerConfig, config_to_dict, load_config
from twinkle.errors import TwinkleError
from twinkle.keys_file import KEY_PREFIXES, NO_LABEL, KeyEntry, add_key, read_entries, revoke, set_tier

CONFIG_ENV = "TWINKLE_SERVER_CONFIG"
NAMESPACE_ENV = "TWINKLE_RAY_NAMESPACE"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_ROLES = ("api", "worker", "flower")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    options = parser.parse_args(argv)
    command: Callable[[argparse.Namespace], int] = options.command
    try:
        return command(options)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    except TwinkleError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="twinkle-server",
        description="Twinkle training-as-a-service server.",
        epilog=f"-c defaults to ${CONFIG_ENV}.",
    )
    commands = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    launch = commands.add_parser("launch", help="start the server and block until it is stopped")
    _add_config_option(launch)
    launch.add_argument(
        "--namespace",
        default=os.environ.get(NAMESPACE_ENV),
        help=f"Ray namespace (default: ${NAMESPACE_ENV}, then the config's ray_namespace)",
    )
    launch.add_argument(
        "--only",
        nargs="+",
        metavar="ROLE",
        help="start one role on this node: 'api', 'worker NAME' (an application name) or 'flower'",
    )
    launch.add_argument(
        "--replica",
        type=int,
        nargs="+",
        action="extend",
        metavar="I",
        help="with --only worker NAME: start only these replicas of the pool (repeatable; default: all), so that "
        "one pool's replicas can run on different nodes",
    )
    launch.add_argument("--host", help="where the API listens, instead of the config's http_options.host")
    launch.add_argument("--port", type=int, help="the API's port, instead of the config's http_options.port")
    launch.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print the workers' Celery banners, per-task lines and library warnings (children log at INFO)",
    )
    launch.set_defaults(command=_launch, parser=launch)

    check = commands.add_parser("check-config", help="validate the config without starting anything")
    _add_config_option(check)
    check.set_defaults(command=_check_config)

    show = commands.add_parser("print-config", help="print the validated config with every default filled in")
    _add_config_option(show)
    show.add_argument(
        "--format", choices=("yaml", "json"), default="yaml", help="output format (default: yaml)"
    )
    show.set_defaults(command=_print_config)

    clear = commands.add_parser("clear", help="delete stored server state")
    clear.add_argument(
        "what", choices=("persistence",), help="what to clear: the persistence backend's state"
    )
    _add_config_option(clear)
    clear.set_defaults(command=_clear)

    tiny = commands.add_parser("build-tiny-model", help="write a tiny random model for tests and demos")
    tiny.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to write the model into")
    tiny.add_argument("--vocab-size", type=int, help="vocabulary size (default: the builder's)")
    tiny.add_argument("--seed", type=int, help="random seed (default: the builder's)")
    tiny.set_defaults(command=_build_tiny_model)

    merged = commands.add_parser("export-merged", help="merge a checkpoint's LoRA into the base model on a server "
                                 "and download the verified Hugging Face model directory")
    merged.add_argument("path", metavar="PATH", help="the checkpoint, twinkle://<run>/<kind>/<name> (or tinker://)")
    merged.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to write the model into")
    merged.add_argument("--base-url", default=os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000"),
                        help="the server (default: $TWINKLE_SERVER_URL, then http://127.0.0.1:8000)")
    merged.add_argument("--api-key", default=os.environ.get("TWINKLE_SERVER_TOKEN"),
                        help="the API key that owns the checkpoint (default: $TWINKLE_SERVER_TOKEN)")
    merged.add_argument("--overwrite", action="store_true", help="replace OUT_DIR when it holds files")
    merged.set_defaults(command=_export_merged)

    stop_ray = commands.add_parser(
        "stop-ray", help="stop the Ray processes of one cluster on this machine (`ray stop` stops every cluster)")
    stop_ray.add_argument("--address", metavar="HOST:PORT",
                          help="the cluster's GCS address, as given to `ray start --address` (default: the "
                          "config's ray.address)")
    stop_ray.add_argument("-c", "--config", default=os.environ.get(CONFIG_ENV), metavar="PATH",
                          help=f"YAML server config whose ray.address to use (default: ${CONFIG_ENV})")
    stop_ray.add_argument("--grace", type=float, default=10.0,
                          help="the longest wait, in seconds, for the raylet and the GCS to end on SIGTERM "
                          "before what is left gets SIGKILL (default: 10)")
    stop_ray.set_defaults(command=_stop_ray, parser=stop_ray)

    reservations = commands.add_parser(
        "reservations", help="show the pools full-parameter runs hold exclusively, or end such a hold")
    reservations.add_argument("--end", metavar="POOL", help="end the hold of this pool (its queue, e.g. "
                              "model.train.0): the run is unloaded within a second, its checkpoints stay, and "
                              "the ops that waited run")
    _add_config_option(reservations)
    reservations.set_defaults(command=_reservations)

    _add_keys_commands(commands)
    return parser


def _add_keys_commands(commands: Any) -> None:
    keys = commands.add_parser("keys", help="manage the API keys of the keys file (only hashes are stored)")
    actions = keys.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="generate a key, print it once, store its hash")
    add.add_argument("--label", default="", help="a name to list and revoke the key by (unique)")
    add.add_argument("--prefix", choices=KEY_PREFIXES, default="tw-",
                     help="key prefix (default tw-; the unmodified Tinker SDK accepts only tml- keys "
                     "unless the client calls twinkle.init_tinker_client())")
    add.add_argument("--tier", default="", help="the key's tier, one of the config's tenancy.tiers "
                     "(default: tenancy.default_tier)")
    add.add_argument("--weight", type=float, help="the key's own fair-share weight, instead of its tier's")
    add.set_defaults(command=_keys_add)
    listing = actions.add_parser("list", help="show hash prefixes, labels, creation times, tiers and weights")
    listing.set_defaults(command=_keys_list)
    update = actions.add_parser("set", help="change a key's tier or weight (effective within ~1 s, no restart)")
    update.add_argument("selector", metavar="LABEL_OR_HASH_PREFIX")
    update.add_argument("--tier", help=f"the new tier ('{NO_LABEL}': back to tenancy.default_tier)")
    update.add_argument("--weight", type=float, help="the key's own fair-share weight (0: its tier's again)")
    update.set_defaults(command=_keys_set)
    revoke = actions.add_parser("revoke", help="remove a key by label or hash prefix (effective within ~1 s)")
    revoke.add_argument("selector", metavar="LABEL_OR_HASH_PREFIX")
    revoke.set_defaults(command=_keys_revoke)
    for action in (add, listing, update, revoke):
        action.add_argument("--keys-file", type=Path, help="the keys file (default: the config's auth.keys_file)")
        action.add_argument("-c", "--config", default=os.environ.get(CONFIG_ENV), metavar="PATH",
                            help=f"YAML server config whose auth.keys_file to use (default: ${CONFIG_ENV})")
        action.set_defaults(parser=action)


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get(CONFIG_ENV)
    parser.add_argument(
        "-c",
        "--config",
        default=default,
        required=default is None,
        metavar="PATH",
        help=f"YAML server config (default: ${CONFIG_ENV})",
    )


def _launch(options: argparse.Namespace) -> int:
    only, only_name = _parse_only(options.parser, options.only)
    config = load_config(options.config)
    if only_name is not None:
        _check_worker_name(options.parser, config, only_name)
    _check_replicas(options.parser, config, only_name, options.replica)
    config = _with_listen_address(options.parser, config, only, options.host, options.port)
    namespace = options.namespace or config.ray_namespace
    from twinkle.config.runtime import runtime_problems

    if only not in ("api", "flower"):
        _refuse_missing_model_dirs(options.config, config, only_name)
    problems = [] if only in ("api", "flower") else runtime_problems(config, only_name)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return EXIT_FAILED
    if only in (None, "api") and (store_problem := _export_store_problem(config)):
        print(f"error: {store_problem}", file=sys.stderr)
        return EXIT_FAILED
    from twinkle.config.inert_keys import inert_keys

    for note in inert_keys(config):
        print(f"[twinkle] note: {note}", flush=True)
    from twinkle.server.launcher import launch  # deferred: it pulls in Ray, Celery and uvicorn

    return launch(
        config_path=options.config,
        config=config,
        only=only,
        only_name=only_name,
        namespace=namespace,
        verbose=options.verbose,
        replicas=options.replica,
    )


def _export_store_problem(config: ServerConfig) -> str | None:
    """A configured export store must answer at launch: a wrong bucket or key would fail every download later."""
    if config.storage.export_store is None:
        return None
    from twinkle.errors import ExportStoreFailure

    try:
        from twinkle.export_store import ExportStore

        store = ExportStore.from_storage(config.storage)
        if store is not None:
            store.check()
    except ImportError:
        return "storage.export_store needs boto3; install the server extra (pip install -e '.[server]')"
    except ExportStoreFailure as exc:
        return str(exc)
    return None


def _refuse_missing_model_dirs(source: str, config: ServerConfig, only_name: str | None = None) -> None:
    """A model directory missing on this machine is a config problem here: it would fail every start."""
    from twinkle.config.model_dirs import model_dir_problems

    problems = model_dir_problems(config, only_name)
    if problems:
        raise ConfigError(problems, source=source)


def _parse_only(parser: argparse.ArgumentParser, words: list[str] | None) -> tuple[str | None, str | None]:
    """`--only` as (role, application name); argparse reports misuse and exits with code 2."""
    if not words:
        return None, None
    role, rest = words[0], words[1:]
    if role not in _ROLES:
        parser.error(f"--only: unknown role {role!r}; choose api, 'worker NAME' or flower")
    if role == "worker":
        if len(rest) != 1:
            parser.error("--only worker takes exactly one application name, e.g. --only worker processor")
        return role, rest[0]
    if rest:
        parser.error(f"--only {role} takes no further arguments (got {' '.join(rest)})")
    return role, None


def _check_worker_name(parser: argparse.ArgumentParser, config: ServerConfig, name: str) -> None:
    """Refuse before launching anything when NAME is not a worker pool of this config."""
    from twinkle.config.apps import ServerApp

    pools = [app.name for app in config.applications if not isinstance(app, ServerApp)]
    if name in pools:
        return
    if any(app.name == name for app in config.applications):
        reason = f"{name!r} is the server application, which runs in the API, not in a worker"
    else:
        close = difflib.get_close_matches(name, pools, n=1)
        reason = f"no application named {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
    parser.error(f"--only worker: {reason}; worker pools: {', '.join(pools) or 'none configured'}")


def _check_replicas(parser: argparse.ArgumentParser, config: ServerConfig, name: str | None,
                    replicas: list[int] | None) -> None:
    """`--replica` picks replicas of the one pool `--only worker NAME` starts, and only ones it has."""
    if not replicas:
        return
    if name is None:
        parser.error("--replica needs --only worker NAME: it picks replicas of that pool")
    from twinkle.server.replica_choice import problem

    app = next(app for app in config.applications if app.name == name)
    if wrong := problem(app, replicas):
        parser.error(f"--replica: {wrong}")


def _with_listen_address(parser: argparse.ArgumentParser, config: ServerConfig, only: str | None,
                         host: str | None, port: int | None) -> ServerConfig:
    """The config with `--host` / `--port` in place of http_options: several API processes on one machine."""
    if host is None and port is None:
        return config
    if only not in (None, "api"):
        parser.error(f"--host and --port say where the API listens; --only {only} runs no API")
    if port is not None and not 0 < port < 65536:
        parser.error(f"--port: {port} is not a TCP port (1 to 65535)")
    listen = config.http_options.model_copy(update={k: v for k, v in (("host", host), ("port", port)) if v})
    return config.model_copy(update={"http_options": listen})


def _check_config(options: argparse.Namespace) -> int:
    config = load_config(options.config)
    _refuse_missing_model_dirs(options.config, config)
    names = ", ".join(f"{app.name} [{app.import_path}]" for app in config.applications)
    count = len(config.applications)
    print(f"ok: {count} application{'s' if count != 1 else ''} ({names})")
    if config.auth.dev_mode:
        print("note: no api_keys or keys_file: development mode, any API key is accepted", file=sys.stderr)
    if config.auth.keys_file:
        tiers = {entry.tier for entry in read_entries(config.auth.keys_file)}
        unknown = sorted(tier for tier in tiers if tier and tier not in config.tenancy.tiers)
        if unknown:
            print(f"warning: {config.auth.keys_file} names tiers that tenancy.tiers lacks ({', '.join(unknown)}); "
                  f"those keys get the default tier {config.tenancy.default_tier!r}", file=sys.stderr)
    from twinkle.config.inert_keys import inert_keys
    from twinkle.config.runtime import runtime_problems

    for note in inert_keys(config):
        print(f"note: {note}", file=sys.stderr)
    for problem in runtime_problems(config):
        print(f"warning: this machine cannot run {problem}", file=sys.stderr)
    return EXIT_OK


def _print_config(options: argparse.Namespace) -> int:
    data = config_to_dict(load_config(options.config))
    if options.format == "json":
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        print(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), end="")
    return EXIT_OK


def _clear(options: argparse.Namespace) -> int:
    config = load_config(options.config)
    from twinkle.state.persistence import clear_persistence  # deferred: it needs a Redis client

    removed = clear_persistence(config, broker_url=_running_broker(config))
    print(f"removed {removed} key{'s' if removed != 1 else ''} from {config.persistence.mode} persistence")
    return EXIT_OK


def _reservations(options: argparse.Namespace) -> int:
    import redis

    from twinkle.catalog import Catalog
    from twinkle.keys import Keys
    from twinkle.pool_reservation import Reservation, end_by_operator

    config = load_config(options.config)
    url = os.environ.get("TWINKLE_BROKER_URL") or config.broker.url or _running_broker(config)
    if not url:
        print("no broker: set broker.url, or run this where the server's `launch` runs", file=sys.stderr)
        return EXIT_USAGE
    r = redis.Redis.from_url(url)
    keys = Keys(config.persistence.key_prefix)
    queues = sorted(Catalog(config).reserving_queues)
    if options.end:
        if options.end not in queues:
            print(f"{options.end} is not a pool that allows full-parameter runs; those are: "
                  f"{', '.join(queues) or '(none)'}", file=sys.stderr)
            return EXIT_USAGE
        held = end_by_operator(r, keys, options.end, "an operator ended it")
        print(f"ended the hold of {held.holder} on {options.end}" if held else f"{options.end} is not held")
        return EXIT_OK
    for queue in queues:
        held = Reservation.from_hash(r.hgetall(keys.pool_reservation(queue)))
        waiting = r.llen(keys.reservation_parked(queue))
        if held is None:
            print(f"{queue}: free")
        else:
            print(f"{queue}: held by {held.holder} (key {held.owner[:12]}) since "
                  f"{time.strftime('%H:%M:%S', time.localtime(held.since))}, until "
                  f"{time.strftime('%H:%M:%S', time.localtime(held.until))}{'; ' + held.over() if held.over() else ''}"
                  f"; {waiting} ops waiting")
    return EXIT_OK


def _running_broker(config: ServerConfig) -> str | None:
    """The embedded broker of the `launch` of this config running on this machine, found by its API port."""
    if os.environ.get("TWINKLE_BROKER_URL") or config.broker.url:
        return None  # the config's own broker
    from twinkle.server import launch_record

    record = launch_record.find(config.http_options.port)
    return record.broker_url if record is not None else None


def _stop_ray(options: argparse.Namespace) -> int:
    from twinkle.server import ray_processes

    address = options.address
    if address is None and options.config:
        address = load_config(options.config).ray.address
    if not address or address == "auto":
        options.parser.error("pass --address HOST:PORT, the GCS address of the cluster to stop (or -c with a "
                             "config whose ray.address is HOST:PORT)")
    try:
        port = ray_processes.gcs_port(address)
    except ValueError as error:
        options.parser.error(f"--address: {error}")
    result = ray_processes.stop(port, grace=options.grace)
    if not result.stopped and not result.refused:
        print(f"no Ray process of the cluster at {address} runs on this machine")
        return EXIT_OK
    if result.stopped:
        killed = f"; {result.killed} needed SIGKILL" if result.killed else ""
        print(f"stopped {len(result.stopped)} Ray processes of the cluster at {address}: "
              f"{ray_processes.summary(result.stopped)}{killed}")
    if result.refused:
        print(f"not allowed to stop PIDs {', '.join(map(str, result.refused))} (another user's); run as that user",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _build_tiny_model(options: argparse.Namespace) -> int:
    from twinkle.tiny_model import build_tiny_model  # deferred: it imports torch and transformers

    # Only what the user gave: the builder owns its defaults.
    overrides: dict[str, Any] = {}
    if options.vocab_size is not None:
        overrides["vocab_size"] = options.vocab_size
    if options.seed is not None:
        overrides["seed"] = options.seed
    print(build_tiny_model(options.out_dir, **overrides))
    return EXIT_OK


def _export_merged(options: argparse.Namespace) -> int:
    from twinkle_client import TwinkleClient, TwinkleClientError  # deferred: only this command needs the client

    if not options.api_key:
        print("export-merged needs an API key: pass --api-key or set TWINKLE_SERVER_TOKEN.", file=sys.stderr)
        return EXIT_USAGE
    try:
        with TwinkleClient(options.base_url, options.api_key) as client:
            export = client.export_merged(options.path)
            directory = client.download_merged(options.path, options.out_dir, overwrite=options.overwrite)
    except TwinkleClientError as error:
        print(f"export-merged: {error}", file=sys.stderr)
        return EXIT_FAILED
    checks = export.export
    print(f"{directory}: {export.status}, largest logprob difference {checks.get('max_abs_diff', float('nan')):.2g} "
          f"(tolerance {checks.get('tolerance', float('nan')):g}), {export.size_bytes / 1e6:.1f} MB in "
          f"{len(export.files)} files")
    return EXIT_OK


def _keys_file_of(options: argparse.Namespace) -> Path:
    if options.keys_file is not None:
        return Path(options.keys_file)
    if not options.config:
        options.parser.error(f"pass --keys-file, or -c with a config that sets auth.keys_file (or ${CONFIG_ENV})")
    keys_file = load_config(options.config).auth.keys_file
    if not keys_file:
        options.parser.error(f"{options.config} sets no auth.keys_file; add one, or pass --keys-file")
    return Path(str(keys_file))


def _keys_add(options: argparse.Namespace) -> int:
    path = _keys_file_of(options)
    _refuse_unknown_tier(options, options.tier)
    raw, entry = add_key(path, options.label, prefix=options.prefix, tier=options.tier, weight=options.weight)
    print(raw)
    print(f"added key {entry.key_hash[:12]}{f' ({entry.label})' if entry.label else ''}{_tier_text(entry)} to "
          f"{path}. This is the only time the key is shown; the file keeps its SHA-256 hash only.", file=sys.stderr)
    return EXIT_OK


def _keys_list(options: argparse.Namespace) -> int:
    path = _keys_file_of(options)
    entries = read_entries(path)
    if not entries:
        print(f"no keys in {path}", file=sys.stderr)
    for entry in entries:
        print(f"{entry.key_hash[:12]}  {entry.label or '-':<24} {entry.created or '-'}{_tier_text(entry)}")
    return EXIT_OK


def _keys_set(options: argparse.Namespace) -> int:
    if options.tier is None and options.weight is None:
        options.parser.error("pass --tier, --weight or both")
    path = _keys_file_of(options)
    if options.tier not in (None, "", NO_LABEL):
        _refuse_unknown_tier(options, options.tier)
    entry = set_tier(path, options.selector, tier=options.tier, weight=options.weight)
    now = _tier_text(entry).strip() or "the default tier, with its weight"
    print(f"key {entry.key_hash[:12]}{f' ({entry.label})' if entry.label else ''}: {now}; running servers apply "
          "it within about a second")
    return EXIT_OK


def _tier_text(entry: KeyEntry) -> str:
    return (f"  tier={entry.tier}" if entry.tier else "") + (f"  weight={entry.weight:g}" if entry.weight else "")


def _refuse_unknown_tier(options: argparse.Namespace, tier: str) -> None:
    """With a config at hand (-c or $TWINKLE_SERVER_CONFIG), a tier it does not define is a usage error."""
    if not tier or not options.config:
        return
    tiers = load_config(options.config).tenancy.tiers
    if tier not in tiers:
        close = difflib.get_close_matches(tier, list(tiers), n=1)
        options.parser.error(f"{options.config} defines no tier {tier!r} under tenancy.tiers"
                             + (f"; did you mean {close[0]!r}?" if close else f" (tiers: {', '.join(tiers)})"))


def _keys_revoke(options: argparse.Namespace) -> int:
    path = _keys_file_of(options)
    for entry in revoke(path, options.selector):
        print(f"revoked key {entry.key_hash[:12]}{f' ({entry.label})' if entry.label else ''}; "
              "running servers refuse it within about a second")
    return EXIT_OK
