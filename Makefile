# Quick start: `make run` (installs what is missing, builds Release, runs the main job) and
# `make test` (installs what is missing, builds, runs the whole suite through CTest).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
CTEST_FLAGS ?=

.PHONY: run test build deps install deb sanitize-asan sanitize-tsan fuzz clean

deps:
	@bash scripts/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# The main job: data-parallel training of the 14.2 M-parameter MLP on Fashion-MNIST, 4 local
# ranks, one epoch (the all-reduce benchmark: gradsync-run -n 4 -- gradsync-bench allreduce).
run: build
	$(BUILD)/tools/gradsync-run -n 4 -- $(BUILD)/examples/gradsync-train --model mlp --epochs 1 \
	  --json $(BUILD)/train.json

# The Python package (gradsync, gradsync.torch) for /usr/bin/python3, under PREFIX.
PREFIX ?= /usr/local
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# A Debian package of the install, for /usr: $(BUILD)/gradsync_<version>_<arch>.deb.
deb: build
	cd $(BUILD) && cpack -G DEB

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 300 $(CTEST_FLAGS)

# GCC 12's LeakSanitizer takes a dynamic TLS block (libucs's, dlopened by the ucx transport)
# that malloc placed 16 bytes past a page boundary for a glibc-2.19 TLS header, reads a bogus
# range from the words before it, and crashes at exit if that thread is still alive ("Tracer
# caught signal 11", google/sanitizers#1322). Where the block lands depends on every earlier
# allocation, so it fails a few tests on one machine and none on another. Not intercepting
# __tls_get_addr leaves only dlopened libraries' thread-locals unscanned.
sanitize-asan:
	ASAN_OPTIONS="$${ASAN_OPTIONS:+$$ASAN_OPTIONS:}intercept_tls_get_addr=0" \
	  $(MAKE) test BUILD=build-asan CMAKE_FLAGS="-DGRADSYNC_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo"

# The threaded parts: this build leaves out the tests labelled single-threaded
# (tests/CMakeLists.txt), which run in the other two. UCX's memory-event hooks patch mmap and
# munmap in the process, which ThreadSanitizer intercepts too: ucx jobs crash under TSan
# unless the hooks are off.
sanitize-tsan:
	UCX_MEM_EVENTS=no $(MAKE) test BUILD=build-tsan \
	  CMAKE_FLAGS="-DGRADSYNC_SANITIZE=thread -DCMAKE_BUILD_TYPE=RelWithDebInfo"

fuzz: deps
	bash scripts/run-fuzz.sh

clean:
	rm -rf build build-asan build-tsan build-fuzz
