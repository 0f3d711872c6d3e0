"""The controller's ledger: what it saw, decided and did, in one SQLite file (WAL).

The ledger is the learning loop: findings, incidents with their timeline, decisions with the gate
that refused them, actions with the exact Slurm call, operator approvals, the circuit breaker, and
the queries `healthctl report` and the rate limiter need.

  * records: the vocabulary (statuses, kinds, states) and the frozen records reads return;
  * schema: the schema version, its migrations and `migrate()`;
  * core: the connection, transactions and reads every store runs on;
  * incidents (with findings and clears), decisions (with approvals), actions (with holds, budgets
    and escalation counts), reintegrations, breaker: one store each, every write and read of it;
  * store: `Ledger`, the stores composed over one connection;
  * reports: the figures people query (repeat offenders, false-positive rate, MTBF, stage timings);
  * accounted: not the ledger but goodput's accounted jobs, in a file of their own beside the
    gathered logs; here with the rest of the controller's SQL.
"""

from healthd.controller.ledger.records import (
    ACTION_STATUSES,
    ACTIVE_REINTEGRATION_STATES,
    APPROVAL_VERDICTS,
    BUDGET_STATUSES,
    CLEAR_SCOPES,
    CLOSED_INCIDENT_STATUSES,
    INBAND_SLOW_STATUS,
    DECISION_OUTCOMES,
    ENDED_STATUSES,
    ESCALATIONS,
    REINTEGRATION_STATES,
    REMEDIATED_STATUSES,
    REMEDIATION_KINDS,
    RESUME_KIND,
    Action,
    Approval,
    BreakerRecord,
    Clear,
    DecisionRecord,
    FindingRecord,
    Incident,
    LedgerError,
    Reintegration,
)
from healthd.controller.ledger.reports import (
    EXCLUDED_INCIDENT_STATUSES,
    FalsePositiveRate,
    NodeMtbf,
    Offender,
    Percentiles,
    percentile,
)
from healthd.controller.ledger.schema import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION, migrate
from healthd.controller.ledger.core import DEFAULT_BUSY_TIMEOUT_S
from healthd.controller.ledger.store import Ledger

__all__ = [
    "ACTION_STATUSES",
    "ACTIVE_REINTEGRATION_STATES",
    "APPLICATION_ID",
    "APPROVAL_VERDICTS",
    "BUDGET_STATUSES",
    "CLEAR_SCOPES",
    "CLOSED_INCIDENT_STATUSES",
    "INBAND_SLOW_STATUS",
    "DECISION_OUTCOMES",
    "DEFAULT_BUSY_TIMEOUT_S",
    "ENDED_STATUSES",
    "ESCALATIONS",
    "EXCLUDED_INCIDENT_STATUSES",
    "MIGRATIONS",
    "REINTEGRATION_STATES",
    "REMEDIATED_STATUSES",
    "REMEDIATION_KINDS",
    "RESUME_KIND",
    "SCHEMA_VERSION",
    "Action",
    "Approval",
    "BreakerRecord",
    "Clear",
    "DecisionRecord",
    "FalsePositiveRate",
    "FindingRecord",
    "Incident",
    "Ledger",
    "LedgerError",
    "NodeMtbf",
    "Offender",
    "Percentiles",
    "Reintegration",
    "migrate",
    "percentile",
]
