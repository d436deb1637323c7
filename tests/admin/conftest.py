"""Fixtures for the admin tests: operators holding chosen permissions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from .helpers import VIEW, permission


@pytest.fixture
def operator(db: None, django_user_model: Any) -> Callable[..., Client]:
    """A logged-in staff user who may view fanout's pages and holds only the given permissions."""
    made = 0

    def login(*codenames: str) -> Client:
        nonlocal made
        made += 1
        user = django_user_model.objects.create_user(
            username=f"operator{made}", password="pw", is_staff=True
        )
        user.user_permissions.add(*(permission(c) for c in (*VIEW, *codenames)))
        client = Client()
        client.force_login(user)
        return client

    return login
