"""What a run publishes for people and tools to find it by, with no worker needed: the search
attributes, the memo holding its view, and the build that started it. Public names: the Web UI,
`temporal workflow list --query`, `tether` and the inbox read them (docs/contract.md)."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

STATE_ATTRIBUTE = SearchAttributeKey.for_keyword("AgentRunState")
TENANT_ATTRIBUTE = SearchAttributeKey.for_keyword("AgentTenant")
SEARCH_ATTRIBUTES = (STATE_ATTRIBUTE, TENANT_ATTRIBUTE)
# The memo key of the run's view (models.RunView), written where the run rests.
VIEW_MEMO = "tether"
# The extern function a worker registers for its audit collector: a run that ends names itself
# to it (worker configuration, like the key ring; activities/audit.py).
COLLECT_EXTERN = "tether_audit_collect"
# The build: every run it starts says so with this one marker at its start (and Temporal's
# TemporalChangeVersion search attribute, which `tether drain` reads). It replays no history
# started by an earlier build: those runs drain on the build that started them
# (docs/changing-workflows.md). A new command order is a new build id, never a patch branch.
BUILD = "tether-build-9"
# The patch under which a run's activity ids derive from history alone (issue 55): runs started
# before it replay with the ids they made (a random draw and the task's clock).
HISTORY_IDS = "tether-history-ids"
CHANGE_VERSION_ATTRIBUTE = SearchAttributeKey.for_keyword_list("TemporalChangeVersion")
