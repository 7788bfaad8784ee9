# blkwire: the two commands a new user needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
BIN := target/release/blkwire

.PHONY: demo demo-rbd test deps build fmt lint unit fuzz-seeds kernel-lab bench fuzz clean

## demo: build, then serve a RAM export, upload a file, read it back, benchmark, stop.
demo: deps build
	@scripts/demo.sh

## demo-rbd: the same with a Ceph RBD image: a one-node cluster under a temp dir
## (scripts/ceph-cluster.sh), an rbd: export, a file up and back (checked through librbd too).
demo-rbd: deps build
	@scripts/demo-rbd.sh

## test: formatting, lints (clippy, rustdoc, the map crate's layering, the fuzz targets built)
## and every test, the fuzz targets over their seeds, then the kernel lab (CI runs this).
test: deps fmt lint unit fuzz-seeds kernel-lab

deps:
	@scripts/deps.sh

build:
	$(CARGO) build --release --locked -p blkwire

fmt:
	$(CARGO) fmt --all --check
	cd fuzz && $(CARGO) fmt --check

lint:
	$(CARGO) clippy --release --locked --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --release --locked --no-deps --workspace --quiet
	crates/map/check-layers.sh
	@# The fuzz targets are a workspace of their own (fuzz/): built here with the stable
	@# toolchain so that a change of an API they use cannot leave them broken unnoticed.
	cd fuzz && $(CARGO) clippy --locked --bins --quiet -- -D warnings

unit:
	$(CARGO) test --release --locked --workspace

## fuzz-seeds: every fuzz target run once over each of its seeds (fuzz/seeds/TARGET/), built
## with the stable toolchain: the decoders' regression test (no fuzzing; `make fuzz` fuzzes).
fuzz-seeds:
	cd fuzz && $(CARGO) build --locked --bins --quiet
	@cd fuzz && for d in seeds/*/; do \
		t=$$(basename $$d); \
		./target/debug/$$t $$d* >target/seeds-$$t.log 2>&1 || \
			{ tail -n 30 target/seeds-$$t.log; echo "fuzz-seeds: $$t failed on one of $$d*"; exit 1; }; \
		echo "fuzz-seeds: $$t: $$(ls $$d | wc -l) seeds ok"; \
	done

## kernel-lab: blkwire against the kernel's own initiators in a qemu guest (docs/KERNEL-LAB.md).
## `make kernel-lab SCENARIO=nbd` runs one scenario; the default is all of them.
kernel-lab: deps build
	tests/kernel-lab/run.sh $(SCENARIO)

## bench: blkwire against nbdkit (fio nbd engine), side by side; see docs/BENCHMARKS.md.
bench: deps build
	bench/nbdkit-compare.sh

## fuzz: a short run of every fuzz target from its seeds (needs a nightly toolchain and
## cargo-fuzz); -max_len fits the largest seeds (the datagram targets').
fuzz:
	cd fuzz && for t in $$(cargo +nightly fuzz list); do mkdir -p corpus/$$t && cargo +nightly fuzz run $$t corpus/$$t seeds/$$t -- -max_total_time=30 -max_len=100000 || exit 1; done

clean:
	$(CARGO) clean
