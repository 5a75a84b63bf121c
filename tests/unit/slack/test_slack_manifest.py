"""The Slack app manifest an admin pastes in: the scopes and URLs the handler relies on."""

from __future__ import annotations

from pathlib import Path

import yaml

MANIFEST = Path(__file__).parents[3] / "slack" / "manifest.yml"


def test_manifest_has_the_scopes_and_urls_the_handler_serves():
    manifest = yaml.safe_load(MANIFEST.read_text())
    scopes = set(manifest["oauth_config"]["scopes"]["bot"])
    assert {"chat:write", "im:write", "users:read", "users:read.email", "commands"} <= scopes
    # A public team channel works without inviting the bot; a private one still needs the invite, and
    # warnings that fail with not_in_channel say so (PermanentDeliveryFailure).
    assert "chat:write.public" in scopes
    # conversations.history: a warning whose outcome was lost is looked for where it was posted
    assert {"im:history", "channels:history", "groups:history"} <= scopes
    assert "files:write" in scopes  # the weekly digest's chart: files_upload_v2 (external upload flow)
    assert manifest["settings"]["interactivity"]["request_url"].endswith("/slack/interactions")
    (command,) = manifest["features"]["slash_commands"]
    assert command["command"] == "/idle-reaper" and command["url"].endswith("/slack/commands")
