"""The clauses of RUNPLAN_CONTRACT.md as data, and ``check_contract``, which judges a
plan (and the ``ProvisionStage`` messages derived from it) clause by clause.

Pure like the rest of ``runplan``: no Hypothesis, no pytest. ``runplan.testing``
turns each clause into an assertion, and ``python -m runplan check`` prints the
verdicts.
"""

from runplan.contract.clauses import CLAUSE, CLAUSES, SECTIONS, Clause
from runplan.contract.report import (
    REJECTION_CLAUSES,
    ContractReport,
    Outcome,
    Verdict,
    check_clause,
    check_contract,
)
from runplan.contract.subject import PlanInputs, Planner

__all__ = [
    "CLAUSE",
    "CLAUSES",
    "REJECTION_CLAUSES",
    "SECTIONS",
    "Clause",
    "ContractReport",
    "Outcome",
    "PlanInputs",
    "Planner",
    "Verdict",
    "check_clause",
    "check_contract",
]
