"""``ace-extproc ctl``: the admin API's client (``admin.py``, ``protos/ace/admin/v1``).

    ace-extproc ctl [--admin ADDR] [--json] pods [--all]   pods: state, load, index size
    ace-extproc ctl lookup KEY       where a prefix key or cache_prefix_id was sent
    ace-extproc ctl drain POD        no new requests for a pod (destination/pod, id, host:port)
    ace-extproc ctl undrain POD      new requests again, once the pod is healthy
    ace-extproc ctl config           the configuration the server runs with (fleet.yaml form)

Tables for people by default, ``--json`` for scripts. Exit status: 0 done; 1 refused
(unknown pod, malformed key) or, for ``lookup``, not found; 2 usage; 3 the admin API
could not be reached. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from ace_extproc.admin import pb, pb_grpc

DEFAULT_ADMIN = "127.0.0.1:9091"
UNREACHABLE = 3
_UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1] if __doc__ else None
    _common(parser, defaults=True)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    # The common options may also come after the action (`ctl pods --json`).
    common = argparse.ArgumentParser(add_help=False)
    _common(common, defaults=False)
    p = sub.add_parser("pods", parents=[common], help="list pods: state, load, index size")
    p.add_argument("--all", action="store_true", help="also pods that left the fleet")
    p = sub.add_parser("lookup", parents=[common], help="where a prefix was sent")
    p.add_argument("key", help="a prefix key (16 hex) or cache_prefix_id (ace-kv-TENANT-KEY)")
    p = sub.add_parser("drain", parents=[common], help="send a pod no new requests")
    p.add_argument("pod", help="destination/pod, or a pod id or host:port naming one pod")
    p = sub.add_parser("undrain", parents=[common], help="let a drained pod take requests")
    p.add_argument("pod", help="destination/pod, or a pod id or host:port naming one pod")
    sub.add_parser("config", parents=[common], help="the configuration the server runs with")


def _common(parser: argparse.ArgumentParser, defaults: bool) -> None:
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--admin",
        default=default(os.environ.get("ACE_ADMIN", DEFAULT_ADMIN)),
        help="the server's admin_listen: host:port or unix:/path "
        f"(default: $ACE_ADMIN, else {DEFAULT_ADMIN})",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON, not a table"
    )
    parser.add_argument(
        "--timeout", type=float, default=default(5.0), help="seconds per call (default 5)"
    )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    # grpc.aio, as everywhere else in ace-extproc: one gRPC stack in a process.
    action = _ACTIONS[args.action]
    try:
        async with grpc.aio.insecure_channel(args.admin) as channel:
            return await action(pb_grpc.AdminStub(channel), args)  # type: ignore[no-untyped-call]
    except grpc.RpcError as exc:
        code = exc.code()
        if code in _UNREACHABLE_CODES:
            _error(
                f"cannot reach the ace-extproc admin API at {args.admin} "
                f"({_details(exc)}); is the server running with admin_listen on?"
            )
            return UNREACHABLE
        _error(_details(exc))
        return 1


# ------------------------------------------------------------------ actions


async def _pods(stub: Any, args: argparse.Namespace) -> int:
    resp = await stub.ListPods(pb.ListPodsRequest(include_removed=args.all), timeout=args.timeout)
    if args.json:
        return _print_json(resp)
    rows = [["POD", "ADDRESS", "STATE", "INFLIGHT", "RUNNING", "WAITING", "KV", "INDEX"]]
    for pod in resp.pods:
        load, index = pod.load, pod.index
        rows.append(
            [
                pod.key,
                pod.address,
                _state(pod),
                str(load.inflight),
                str(load.running),
                str(load.waiting),
                f"{load.kv_usage:.0%}",
                f"{index.blocks_held}/{index.capacity_blocks}",
            ]
        )
    _table(rows, right={3, 4, 5, 6, 7})
    if not resp.pods:
        print("(no pods)")
    return 0


async def _lookup(stub: Any, args: argparse.Namespace) -> int:
    resp = await stub.LookupPrefix(pb.LookupPrefixRequest(key=args.key), timeout=args.timeout)
    if args.json:
        _print_json(resp)
        return 0 if resp.found else 1
    what = f"prefix {resp.prefix_key}" + (f" (tenant {resp.tenant})" if resp.tenant else "")
    if not resp.recording:
        print(f"{what}: this server does not record its picks for lookups")
        return 1
    if not resp.found:
        print(
            f"{what}: not routed by this server recently "
            f"(it remembers the last {resp.capacity} prefixes)"
        )
        return 1
    print(f"{what}: {resp.picks} picks, the last {resp.last_pick_age_s:.1f} s ago")
    rows = [["POD", "ADDRESS", "STATE", "LAST"]]
    for place in resp.placements:
        rows.append(
            [place.pod.key, place.pod.address, _state(place.pod), "*" if place.last else ""]
        )
    _table(rows)
    return 0


async def _drain(stub: Any, args: argparse.Namespace) -> int:
    resp = await stub.DrainPod(pb.DrainPodRequest(pod=args.pod), timeout=args.timeout)
    if args.json:
        return _print_json(resp)
    pod = resp.pod
    done = "drained" if resp.changed else "was already draining"
    print(f"{pod.key} {done}: it gets no new requests")
    _print_remaining(pod, resp.destination_available)
    return 0


async def _undrain(stub: Any, args: argparse.Namespace) -> int:
    resp = await stub.UndrainPod(pb.UndrainPodRequest(pod=args.pod), timeout=args.timeout)
    if args.json:
        return _print_json(resp)
    pod = resp.pod
    done = "undrained" if resp.changed else "was not drained"
    if pod.available:
        print(f"{pod.key} {done}: it takes new requests")
    else:
        print(f"{pod.key} {done}, but is {_state(pod)}: it takes new requests once healthy")
    _print_remaining(pod, resp.destination_available)
    return 0


async def _config(stub: Any, args: argparse.Namespace) -> int:
    resp = await stub.GetConfig(pb.GetConfigRequest(), timeout=args.timeout)
    if args.json:
        return _print_json(resp)
    print(f"# ace-extproc {resp.version}, mode {resp.mode}, admin API on {resp.admin_listen}")
    sys.stdout.write(resp.yaml)
    return 0


_ACTIONS: dict[str, Callable[[Any, argparse.Namespace], Awaitable[int]]] = {
    "pods": _pods,
    "lookup": _lookup,
    "drain": _drain,
    "undrain": _undrain,
    "config": _config,
}


# ------------------------------------------------------------------ output


def _state(pod: Any) -> str:
    state = _enum_name(pb.PodState.Name(pod.state))
    if pod.ejected:  # passive health's, not the health checks'
        state += " (ejected)" if pod.drained else " (ejected: its requests failed)"
    elif pod.drained and not pod.healthy:
        state += " (down)"
    return state


def _enum_name(name: str) -> str:
    return name.removeprefix("POD_STATE_").lower()


def _print_remaining(pod: Any, available: int) -> None:
    if available:
        print(f"{available} pod(s) of {pod.destination} take new requests")
    else:
        print(
            f"warning: no pod of {pod.destination} takes new requests: its requests pass "
            "through unrouted (bypass_no_pod) to Envoy's default route"
        )


def _table(rows: list[list[str]], right: Collection[int] = ()) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def _print_json(msg: Message) -> int:
    print(json.dumps(to_dict(msg), indent=2))
    return 0


def to_dict(msg: Message) -> dict[str, Any]:
    """A message as plain JSON: every field (defaults too), 64-bit integers as numbers
    (not strings, as protobuf's JSON mapping has them), enums by short name."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return _enum_name(field.enum_type.values_by_number[value].name)
    return value


def _details(exc: grpc.RpcError) -> str:
    details = exc.details() if hasattr(exc, "details") else None
    return str(details or exc.code().name.lower())


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """``ace-extproc ctl ARGS`` without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="ace-extproc ctl", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
