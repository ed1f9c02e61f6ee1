"""``python -m runplan check PLAN.json [--json]``: every clause of RUNPLAN_CONTRACT.md
over a plan read off the wire, with pass or what broke it.

The input is one JSON document: a ``RunPlan`` as ``runplan.wire`` encodes it, or an
object ``{"plan": <RunPlan>, "provisions": [<ProvisionStage>, ...]}`` (provisions
optional; ``python -m runplan plan --json`` writes such an object, with a ``memory``
key that is ignored, and ``python -m runtime_cupy plan --json`` one with a ``stages``
key, ignored too). Without provisions, those derived with ``provision_all`` are
checked. Exit status: 0 when every clause holds, 2 when one is broken, 1 when the
input cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from runplan import wire
from runplan.contract import SECTIONS, ContractReport, Outcome, Verdict, check_contract
from runplan.json_errors import CONTRACT_BROKEN, error_json, print_json, rejection_fields
from runplan.messages import ProvisionStage
from runplan.plan import RunPlan
from runplan.rejections import PlanRejection

EXIT_BROKEN = 2
EXIT_INPUT = 1
#: Largest document read: a plan and one provision per stage.
MAX_DOCUMENT_BYTES = 4 * wire.MAX_MESSAGE_BYTES
#: the keys of a document object; ``memory`` (``runplan plan --json``'s) and ``stages``
#: (``runtime_cupy plan --json``'s: each stage's memory and host) describe the plan and
#: are not checked
_DOCUMENT_KEYS = frozenset({"plan", "provisions", "memory", "stages"})


class UnreadableInput(Exception):
    """A document that is not a plan (and provisions) in the wire format."""


def add_check_parser(sub: Any) -> None:
    """Register ``check`` on the subparsers of ``python -m runplan``."""
    p = sub.add_parser(
        "check",
        help="check a plan (and its provisions) against every clause of the contract",
        description="Check a RunPlan read off the wire against every clause of "
        "RUNPLAN_CONTRACT.md: check_plan's guarantees and the provisioning projection. "
        "Prints each clause with pass or what broke it. Exit status 0 when every clause "
        "holds, 2 when one is broken, 1 when the input cannot be read.",
    )
    p.add_argument(
        "plan",
        metavar="PLAN.json",
        help='a RunPlan as runplan.wire encodes it, or {"plan": RunPlan, "provisions": '
        "[ProvisionStage, ...]} (what `python -m runplan plan --json` writes also "
        "reads); - for standard input",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        plan, provisions = read_document(args.plan)
    except UnreadableInput as exc:
        source = "standard input" if args.plan == "-" else args.plan
        message = " ".join(f"{source}: {exc}".split())  # one line, whatever the cause
        if args.json:
            print_json(error_json("UnreadableInput", message))
        else:
            sys.stderr.write(f"error: {message}\n")
        return EXIT_INPUT
    report = check_contract(plan, provisions)
    if args.json:
        print_json(report_json(report, plan, args.plan))
    else:
        sys.stdout.write(report_text(report, plan, args.plan))
    return 0 if report.holds else EXIT_BROKEN


def read_document(path: str) -> tuple[RunPlan, tuple[ProvisionStage, ...] | None]:
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_DOCUMENT_BYTES + 1)
        else:
            with Path(path).open("rb") as f:
                data = f.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise UnreadableInput(f"cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise UnreadableInput(f"larger than {MAX_DOCUMENT_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UnreadableInput(f"not a JSON document: {exc}") from None
    if isinstance(doc, dict) and "type" in doc:
        return _message(data, RunPlan, "the document"), None
    if not isinstance(doc, dict) or "plan" not in doc:
        raise UnreadableInput(
            'expected a RunPlan (an object with "type": "RunPlan") or an object with '
            f'"plan" and optionally "provisions", not {_kind(doc)}'
        )
    extra = sorted(set(doc) - _DOCUMENT_KEYS)
    if extra:
        raise UnreadableInput(f"unknown key {extra[0]!r} (known: plan, provisions, memory, stages)")
    plan = _message(_encode(doc["plan"]), RunPlan, "plan")
    if "provisions" not in doc:
        return plan, None
    items = doc["provisions"]
    if not isinstance(items, list):
        raise UnreadableInput(f"provisions: expected a list, not {_kind(items)}")
    return plan, tuple(
        _message(_encode(item), ProvisionStage, f"provisions[{i}]") for i, item in enumerate(items)
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number the wire allows")


def _kind(value: object) -> str:
    names: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}
    return names.get(type(value), "a scalar")


def _encode(value: object) -> bytes:
    return json.dumps(value).encode()


def _message(data: bytes, cls: type[Any], where: str) -> Any:
    try:
        obj = wire.loads(data)
    except wire.WireError as exc:
        raise UnreadableInput(f"{where}: {exc}") from None
    if not isinstance(obj, cls):
        raise UnreadableInput(f"{where}: expected a {cls.__name__}, got a {type(obj).__name__}")
    return obj


# -- output ----------------------------------------------------------------------------

_MARK = {Outcome.HOLDS: "pass", Outcome.BROKEN: "FAIL", Outcome.NOT_CHECKED: "skip"}


def _summary(report: ContractReport) -> str:
    counts = {o: sum(v.outcome is o for v in report.verdicts) for o in Outcome}
    text = (
        f"{len(report.verdicts)} clauses: {counts[Outcome.HOLDS]} pass, "
        f"{counts[Outcome.BROKEN]} broken"
    )
    if counts[Outcome.NOT_CHECKED]:
        text += f", {counts[Outcome.NOT_CHECKED]} not checked"
    return text


def report_text(report: ContractReport, plan: RunPlan, source: str) -> str:
    provisions = (
        "provisions as given"
        if report.provisions_given
        else "provisions derived from the plan with provision_all"
    )
    lines = [
        f"{'standard input' if source == '-' else source}: run {plan.run_id!r}, "
        f"{len(plan.stages)} stages, {len(plan.edges)} edges; {provisions}",
    ]
    for section in SECTIONS:
        lines.append(section)
        for v in report.verdicts:
            if v.clause.section == section:
                lines.append(f"  {_MARK[v.outcome]}  {v.clause.text}")
                if v.outcome is not Outcome.HOLDS:
                    lines.append(f"        {v.explain()}")
    lines.append(_summary(report))
    return "\n".join(lines) + "\n"


def _rejection_json(rejection: PlanRejection | None) -> dict[str, Any] | None:
    return None if rejection is None else rejection_fields(rejection)


def _verdict_json(v: Verdict) -> dict[str, Any]:
    return {
        "name": v.clause.name,
        "section": v.clause.section,
        "text": v.clause.text,
        "verdict": v.outcome.value,
        "problems": list(v.problems),
        "rejection": _rejection_json(v.rejection),
        "note": v.note,
    }


def report_json(report: ContractReport, plan: RunPlan, source: str) -> dict[str, Any]:
    """The report as one object; with the error ``ContractBroken`` beside it when a
    clause is broken (``message``: the broken clauses by name, and the summary)."""
    doc: dict[str, Any] = {
        "holds": report.holds,
        "source": source,
        "run_id": plan.run_id,
        "stage_count": len(plan.stages),
        "edge_count": len(plan.edges),
        "provisions": "given" if report.provisions_given else "derived",
        "clauses": [_verdict_json(v) for v in report.verdicts],
        "rejection": _rejection_json(report.rejection),
        "summary": _summary(report),
    }
    if report.broken:
        names = ", ".join(v.clause.name for v in report.broken)
        message = f"contract broken: {names} ({_summary(report)})"
        doc |= error_json(CONTRACT_BROKEN, message)
    return doc
