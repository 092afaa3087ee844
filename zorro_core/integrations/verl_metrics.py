"""Moved to `zorro_core.integrations.verl.metrics`; this path warns and is removed after 2027-06-01."""

from zorro_core.integrations.deprecated import moved

moved(__name__)
