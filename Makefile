# Two commands matter: `make demo` and `make test`. Both bootstrap what they need:
# uv (into .tools/ when it is not on PATH), then the locked environment in .venv/.
SHELL := /bin/bash
UV := $(shell command -v uv 2>/dev/null || echo $(CURDIR)/.tools/bin/uv)
RUN := $(UV) run --frozen
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
# Every interpreter the suite starts (two pytest workers, `cdk synth`'s app, the demo and CLI in subprocesses)
# imports the same modules: with bytecode cached, each compiles only what no earlier one did (aws_cdk alone is
# about 6 s of CPU per process without it). An environment's PYTHONDONTWRITEBYTECODE would make every process
# compile everything again. The cache is kept apart from the sources, in .pycache/ (ignored by git); not under
# .venv/, which the bootstrap's first Python would create before uv can make it a virtual environment.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(CURDIR)/.pycache

.PHONY: demo test test-synth test-pytest test-checks ruff-then-compile ruff lint typecheck unit integration bench sync

$(CURDIR)/.tools/bin/uv:
	python3 -m venv $(CURDIR)/.tools
	$(CURDIR)/.tools/bin/pip install --quiet --disable-pip-version-check 'uv>=0.5,<1'

.venv/.synced: uv.lock pyproject.toml | $(UV)
	$(UV) sync --frozen --all-groups --quiet
	touch $@

sync: .venv/.synced

demo: sync
	$(RUN) idle-reaper demo

lint: ruff typecheck

ruff: sync
	$(RUN) ruff check .
	$(RUN) ruff format --check .

typecheck: sync
	$(RUN) mypy

# The whole suite: lint, types, unit, integration (moto server + Slack fake), infra, and a CDK synth
# with cdk-nag, linted by cfn-lint. pytest exits 5 when it collected no tests; make treats that as the failure it is.
# The synth is the infra tests' app (two regions, an alarm e-mail: tests/infra/synthesis.py), written to
# cdk.out.test/ so a `make synth` for a deploy is left alone, and without the CLI's version, path and asset
# metadata, so it is byte for byte what the tests would synthesize: they read it (IDLE_REAPER_TEST_SYNTH) instead
# of synthesizing it again.
# worksteal: each worker starts on one half of the suite, in order, and an idle one takes half of what the other
# has left, so a module's tests mostly stay on one worker (one moto CloudFormation import, one demo run) and the
# last minute is shared.
# tests/budget.py fails the run when a test or a module passes its time budget (the limits are there).
# Two steps of two jobs each. First what pytest needs: ruff, then the precompile (one core), beside the synth (node
# and one Python). Then pytest, beside mypy and cfn-lint, which pytest does not need: its two workers leave a core
# idle for a good part of the run (they wait on servers and subprocesses they start), and the two checks (about
# 15 s of one core) take it. Any of them failing fails `make test` once the others have finished.
TEST_SYNTH := $(CURDIR)/cdk.out.test
TEST_SYNTH_CONTEXT := -c regions=eu-west-1,us-east-2 -c alarmEmail=ops@example.com
test: sync
	$(MAKE) --no-print-directory -j2 --output-sync=target ruff-then-compile test-synth
	$(MAKE) --no-print-directory -j2 --output-sync=line test-pytest test-checks

test-pytest: sync
	IDLE_REAPER_TEST_SYNTH=$(TEST_SYNTH) $(RUN) pytest -n 2 --dist worksteal -q -p no:cacheprovider

# The core ruff leaves free while the synth runs compiles what pytest, its workers and their subprocesses import
# (about 12 s of one core on a fresh clone, which the two workers would otherwise each pay at their start). Left
# out: what only the synth, cfn-lint and mypy load (they compile their own, sympy and networkx among cfn-lint's),
# and the packages' own tests.
PRECOMPILE_SKIP := '/(aws_cdk|cfnlint|cdk_nag|constructs|jsii|mypy|mypyc|mypy_boto3_[a-z0-9_]+|ruff|debugpy|babel|pip|setuptools|sympy|networkx|mpmath|graphql|fontTools)/|/site-packages/.*/tests?/'
ruff-then-compile: ruff
	$(RUN) python -m compileall -q -x $(PRECOMPILE_SKIP) lambdas tools testkit tests \
		"$$($(RUN) python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null

test-synth: sync
	rm -rf $(TEST_SYNTH)  # bundled by this checkout: CDK keeps an asset directory it finds, and the layer test reads them
	$(MAKE) --no-print-directory synth CDK_ARGS='--output $(TEST_SYNTH) --no-version-reporting --no-path-metadata --no-asset-metadata $(TEST_SYNTH_CONTEXT)'

# Zero errors; W3005 is the DependsOn CDK adds beside a GetAtt on every function's role.
test-checks: typecheck
	$(RUN) cfn-lint --non-zero-exit-code error --ignore-checks W3005 -- $(TEST_SYNTH)/*.template.json

bench: sync
	$(RUN) python benchmarks/sweep_cost.py
	$(RUN) python benchmarks/sweep_latency.py --sizes 1000,10000,50000 --bills 1000,10000,50000 --every 5,15
	$(RUN) python benchmarks/slack_throughput.py
	$(RUN) python benchmarks/doctor_calls.py --sizes 50000
	$(RUN) python benchmarks/organization_calls.py
	$(RUN) python benchmarks/organization_sweep.py
	$(RUN) python benchmarks/read_when_due.py
	$(RUN) python benchmarks/kind_lookups.py
	$(RUN) python benchmarks/savings.py
	$(RUN) python benchmarks/slack_latency.py
	$(RUN) python benchmarks/layer_sizes.py

# CDK targets (synth, deploy) live beside the stack.
-include infra/make.mk
