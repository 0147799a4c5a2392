"""Where a run's history goes: one governed and one bare run of M steps, event by event.

    python -m bench.anatomy [--steps 5] [--approval] [--show-events] [--can-after EVENTS]

Runs them one at a time on a private dev server and prints, per variant: events and bytes by
event type; activities and local activities (markers) by type with their payload bytes;
search-attribute upserts with the values they wrote; workflow tasks; and the largest events.
The governed run's extra events and bytes over the bare one are what governance writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections import defaultdict

from bench.common import Stack, chain_events, event_kind, machine_line, stack_or_new, table
from bench.overhead import APPROVAL, BARE, GOVERNED, TETHER, run_batch


def _payload_bytes(payloads) -> int:
    return sum(p.ByteSize() for p in payloads.payloads) if payloads is not None else 0


def _marker(e) -> tuple[str, int]:
    """A marker's name (a local activity's type, or the patch id) and its payload bytes."""
    a = e.marker_recorded_event_attributes
    size = sum(_payload_bytes(v) for v in a.details.values())
    name = a.marker_name
    if name == "core_local_activity" and "data" in a.details and a.details["data"].payloads:
        try:
            data = json.loads(a.details["data"].payloads[0].data)
            name = f"local activity {data.get('activity_type', '?')}"
        except (ValueError, UnicodeDecodeError):
            pass
    elif name == "core_patch" and "patch_data" in a.details and a.details["patch_data"].payloads:
        try:
            name = f"patch {json.loads(a.details['patch_data'].payloads[0].data).get('id', '?')}"
        except (ValueError, UnicodeDecodeError):
            pass
    return name, size


def _upsert(e) -> str:
    fields = e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
    return ", ".join(f"{k}={p.data.decode(errors='replace')}" for k, p in sorted(fields.items()))


def anatomy(events: list) -> dict:
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # activity / local activity -> count, bytes
    scheduled: dict[int, str] = {}
    upserts: list[str] = []
    largest: list[tuple[int, str]] = []
    for e in events:
        kind = event_kind(e)
        size = e.ByteSize()
        by_kind[kind][0] += 1
        by_kind[kind][1] += size
        label = kind
        if kind == "ACTIVITY_TASK_SCHEDULED":
            name = e.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[e.event_id] = name
            by_op[f"activity {name}"][0] += 1
            by_op[f"activity {name}"][1] += size
            label = f"{kind} {name} (input {_payload_bytes(e.activity_task_scheduled_event_attributes.input)} B)"
        elif kind in ("ACTIVITY_TASK_STARTED", "ACTIVITY_TASK_COMPLETED"):
            attrs = (e.activity_task_started_event_attributes if kind == "ACTIVITY_TASK_STARTED"
                     else e.activity_task_completed_event_attributes)
            name = scheduled.get(attrs.scheduled_event_id, "?")
            by_op[f"activity {name}"][1] += size
            if kind == "ACTIVITY_TASK_COMPLETED":
                label = f"{kind} {name} (result {_payload_bytes(attrs.result)} B)"
        elif kind == "MARKER_RECORDED":
            name, payload = _marker(e)
            by_op[name][0] += 1
            by_op[name][1] += size
            label = f"{kind} {name} (payloads {payload} B)"
        elif kind == "WORKFLOW_EXECUTION_CONTINUED_AS_NEW":
            carried = _payload_bytes(e.workflow_execution_continued_as_new_event_attributes.input)
            by_op["continue-as-new input"][0] += 1
            by_op["continue-as-new input"][1] += carried
            label = f"{kind} (input {carried} B)"
        elif kind == "WORKFLOW_EXECUTION_STARTED":
            label = f"{kind} (input {_payload_bytes(e.workflow_execution_started_event_attributes.input)} B)"
        elif kind == "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES":
            upserts.append(_upsert(e))
            label = f"{kind} {upserts[-1]}"
        largest.append((size, f"#{e.event_id} {label}"))
    largest.sort(reverse=True)
    return dict(by_kind=dict(by_kind), by_op=dict(by_op), upserts=upserts, largest=largest,
                events=len(events), bytes=sum(e.ByteSize() for e in events))


async def main_async(args: argparse.Namespace, stack: Stack | None = None) -> None:
    names = [GOVERNED, *([APPROVAL] if args.approval else []), BARE]
    print(f"# Where history goes: one run of {args.steps} steps per variant ({', '.join(names)})")
    print(f"machine: {machine_line()}")
    found = {}
    dynamic = [f"limit.historyCount.suggestContinueAsNew={args.can_after}"] if args.can_after else []
    async with stack_or_new(stack, dynamic_config=dynamic) as stack:
        stamp = uuid.uuid4().hex[:6]
        for name in names:
            batch = await run_batch(stack, TETHER[name], 1, args.steps, f"a{stamp}{names.index(name)}")
            events, _ = await chain_events(stack.client, batch.handles[0].id, batch.handles[0].first_execution_run_id)
            found[name] = anatomy(events)
            if args.show_events:
                print(f"\n{name}:")
                for e in events:
                    print(f"  {e.event_id:>3} {event_kind(e):<36} {e.ByteSize():>6} B")
    print()
    kinds = sorted(set().union(*(f["by_kind"] for f in found.values())))
    print(table(
        ["event type", *(f"{n} events" for n in names), *(f"{n} bytes" for n in names)],
        [[k, *(found[n]["by_kind"].get(k, [0, 0])[0] for n in names),
          *(found[n]["by_kind"].get(k, [0, 0])[1] for n in names)] for k in kinds]
        + [["total", *(found[n]["events"] for n in names), *(found[n]["bytes"] for n in names)]],
    ))
    print()
    ops = sorted(set().union(*(f["by_op"] for f in found.values())))
    print("activities (scheduled + started + completed events) and markers, by type:")
    print(table(
        ["operation", *(f"{n} count" for n in names), *(f"{n} bytes" for n in names)],
        [[o, *(found[n]["by_op"].get(o, [0, 0])[0] for n in names),
          *(found[n]["by_op"].get(o, [0, 0])[1] for n in names)] for o in ops],
    ))
    for n in names:
        if found[n]["upserts"]:
            print(f"\n{n}: search-attribute upserts, in order:")
            for u in found[n]["upserts"]:
                print(f"  {u}")
    for n in names:
        print(f"\n{n}: largest events")
        for size, label in found[n]["largest"][: args.largest]:
            print(f"  {size:>6} B  {label}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--approval", action="store_true", help="also a governed run that waits for one approval")
    p.add_argument("--largest", type=int, default=10, help="how many of the largest events to list")
    p.add_argument("--show-events", action="store_true", help="list every event")
    p.add_argument("--can-after", type=int, default=0,
                   help="the dev server suggests continue-as-new after this many events (0: its default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(main_async(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
