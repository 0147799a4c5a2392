"""Audit: the sinks every timeline record goes to, the collector, and the checks that a record or a view is the fleet's."""
