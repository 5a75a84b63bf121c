"""idle-reaper's local tools: the `idle-reaper` command, the demo, the local moto world, the Slack
fake and trace replay. They install with the package but never ship in the Lambda asset."""
