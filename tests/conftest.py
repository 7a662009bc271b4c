"""Fixtures only; what tests share otherwise is in helpers.py."""

from __future__ import annotations

import pytest

from helpers import GitRepo


@pytest.fixture
def git_repo(tmp_path):
    """An empty git repository with an identity, for git apply / git am checks."""
    repo = GitRepo(tmp_path / "repo")
    repo.mkdir()
    repo.git("init", "-q")
    repo.git("config", "user.email", "test@example.com")
    repo.git("config", "user.name", "Test")
    repo.git("config", "commit.gpgsign", "false")
    return repo
