# blkwire: the two commands a new user needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
BIN := target/release/blkwire

.PHONY: demo test deps build fmt lint unit bench fuzz clean

## demo: build, then serve a RAM export, upload a file, read it back, benchmark, stop.
demo: deps build
	@scripts/demo.sh

## test: formatting, lints and every test (CI runs this).
test: deps fmt lint unit

deps:
	@scripts/deps.sh

build:
	$(CARGO) build --release --locked -p blkwire

fmt:
	$(CARGO) fmt --all --check

lint:
	$(CARGO) clippy --release --locked --all-targets -- -D warnings

unit:
	$(CARGO) test --release --locked --workspace

## bench: blkwire against nbdkit (fio nbd engine), side by side; see docs/BENCHMARKS.md.
bench: deps build
	bench/nbdkit-compare.sh

## fuzz: a short run of every fuzz target (needs a nightly toolchain and cargo-fuzz).
fuzz:
	cd fuzz && for t in $$(cargo +nightly fuzz list); do cargo +nightly fuzz run $$t -- -max_total_time=30 || exit 1; done

clean:
	$(CARGO) clean
