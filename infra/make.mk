# CDK targets, included from the Makefile (`-include infra/make.mk`).
#
#   make synth                       # synthesize into cdk.out/ (runs cdk-nag; builds the layer)
#   make deploy                      # deploy every stack of the app (one per configured region)
#   make deploy CDK_ARGS='-c alarmEmail=ops@example.com -c regions=us-east-1,eu-west-1'
#
# The CDK CLI is the one pinned in package.json/package-lock.json; `npx --no-install` never fetches
# another. Synth talks to no network service: notices and CLI telemetry are off in cdk.json, the
# version check is off here, and only the dependency layer's wheels come from the Python index
# (once per uv.lock change; cdk.out/ and the uv cache keep them).

CDK := npx --no-install cdk
CDK_ARGS ?=

export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export CDK_DISABLE_VERSION_CHECK := 1
export CDK_DISABLE_CLI_TELEMETRY := true

.PHONY: synth deploy diff bootstrap

# npm ci writes node_modules/.package-lock.json; reinstall when it is missing or the lock changed.
node_modules/.package-lock.json: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error

synth: sync node_modules/.package-lock.json
	$(CDK) synth --quiet $(CDK_ARGS)

diff: sync node_modules/.package-lock.json
	$(CDK) diff --all $(CDK_ARGS)

# Once per account and region, before the first deploy.
bootstrap: sync node_modules/.package-lock.json
	$(CDK) bootstrap $(CDK_ARGS)

deploy: sync node_modules/.package-lock.json
	$(CDK) deploy --all $(CDK_ARGS)
