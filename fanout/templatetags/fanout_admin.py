"""Template tags of fanout's admin pages that Django's own change forms render."""

from __future__ import annotations

from typing import Any

from django import template

from ..admin.spend import item_spend
from ..models import ItemClaim

register = template.Library()


@register.simple_tag
def spend_of(item: ItemClaim | None) -> dict[str, Any] | None:
    """An item's spend by unit for spend_panel.html; None when it counts no cost."""
    return item_spend(item) if item is not None else None
