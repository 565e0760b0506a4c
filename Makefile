.PHONY: run test bench lint

# The quickstart: venv, install, migrate, start web + exec + tools workers + beat, run a demo job.
run:
	@scripts/run.sh

# The whole suite against real PostgreSQL and Redis (found, or started for the run).
test:
	@scripts/test.sh $(ARGS)

bench:
	@scripts/bench.sh $(ARGS)

lint:
	@.venv/bin/ruff check . && .venv/bin/ruff format --check .
