"""The other shipped-config rehearsals of tests/integration/test_rehearsal.py (`IN_SECOND_FILE`): the same
test, in a file of its own only so that pytest-xdist's two workers share the rehearsals."""

from __future__ import annotations

import pytest

from tests.integration.test_rehearsal import IN_SECOND_FILE, check_rehearsal


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_SECOND_FILE)
def test_shipped_config_rehearses(name):
    check_rehearsal(name)
