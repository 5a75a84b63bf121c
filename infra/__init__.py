"""The idle-reaper CDK app: constructs, the stack, and Docker-free bundling of the Lambda layer."""
