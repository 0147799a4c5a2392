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
# TemporalChangeVersion search attribute, which `tether drain` reads). A new command order is a
# new build id, never a patch branch (docs/changing-workflows.md). Its runs make their activity
# ids from history alone and have every fix the live patches (workflows/effects.py) bring.
BUILD = "tether-build-10"
# The one earlier build whose runs this build still replays: they made their activity ids from a
# random draw and the task's clock, and take each fix where their history says (its patch
# marker). Runs of any build before it drain on the build that started them.
PREVIOUS_BUILD = "tether-build-9"
# The patch under which a run of the previous build made its activity ids from the run's seed
# (the fix for a replaced worker's query, issue 55): such a run replays with those ids.
HISTORY_IDS = "tether-history-ids"
CHANGE_VERSION_ATTRIBUTE = SearchAttributeKey.for_keyword_list("TemporalChangeVersion")
