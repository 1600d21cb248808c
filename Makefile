# Upsquad core services — the one entry point: build, run, test, bench, lint.
#
#   make            build every executable into build/bin/
#   make asan       the same with AddressSanitizer + UBSan into build-asan/
#   make tsan       the test programs with ThreadSanitizer into build-tsan/
#   make run        bring the local runtime up (servers, migrations, services)
#   make stop       stop what `make run` started, by pid
#   make test       every test, on a throw-away runtime (also the sanitizer build)
#   make bench      benchmarks against their limits (ratios)
#   make deps       install the Debian packages the project needs (idempotent)
#   make lint       clang-format check
#
# Conventions (new code needs no Makefile edits):
#   libcommon/*.c                 -> $(BUILD)/lib/libcommon.a
#   services/<svc>/*.c but main.c -> $(BUILD)/lib/lib<svc>.a ; with main.c -> $(BUILD)/bin/<svc>
#   tests/unit/test_*.c           -> $(BUILD)/tests/unit/test_*       (libcommon)
#   tests/unit/<svc>/test_*.c     -> $(BUILD)/tests/unit/<svc>_test_* (lib<svc> + libcommon)
#   tests/integration/test_*.c    -> $(BUILD)/tests/integration/test_*
#   tests/support/<prog>/*.c      -> $(BUILD)/bin/<prog>   (test servers and tools)
#   bench/<prog>/*.c              -> $(BUILD)/bin/<prog>   (bench/<area>/bench.sh run by make bench)
#   tools/<prog>/*.c              -> $(BUILD)/bin/<prog>   (operator tools, built by `make`)
#   tools/<prog>/<prog> (no .c)   -> $(BUILD)/bin/<prog>   (script tools: a symlink, e.g. upsq)
#   tests/**/test_*.py, test_*.sh -> run by tests/run.sh
# Optional per-area make fragments: services/*/service.mk, tests/*/tests.mk.

BUILD ?= build
CC    ?= cc
SAN   ?=
OPT   ?= -O2

CFLAGS_WARN := -Wall -Wextra -Werror -Wno-missing-field-initializers
CFLAGS  := -std=c11 -D_GNU_SOURCE -g $(OPT) -pthread -fno-omit-frame-pointer $(CFLAGS_WARN)
ifeq ($(SAN),1)
CFLAGS  += -fsanitize=address,undefined -fno-sanitize-recover=undefined
LDFLAGS += -fsanitize=address,undefined
endif
# ThreadSanitizer (make tsan): the test programs, for data races between our threads
ifeq ($(SAN),thread)
CFLAGS  += -fsanitize=thread
LDFLAGS += -fsanitize=thread
endif
LDFLAGS += -Wl,--as-needed
INCS    := -I$(BUILD)/gen -Ilibcommon -I/usr/include/postgresql
LIBS    := -lgrpc -lgpr -lprotobuf-c -lpq -lhiredis -lnats -lcjson -lmicrohttpd -lssl -lcrypto -lpthread -lm
# -MD, not -MMD: system headers are listed too, so tests/scripts/test_deps.py can check that
# scripts/deps.sh declares the package of every header the build includes.
DEPFLAGS = -MD -MP

PROTOC   ?= protoc
PROTOC_C ?= protoc-c
WKT      := timestamp struct any empty duration
PROTOS   := $(shell find proto -name '*.proto' 2>/dev/null | sort)
TPROTOS  := $(shell find tests/proto -name '*.proto' 2>/dev/null | sort)
GEN_C    := $(PROTOS:proto/%.proto=$(BUILD)/gen/%.pb-c.c) \
            $(WKT:%=$(BUILD)/gen/google/protobuf/%.pb-c.c)
TGEN_C   := $(TPROTOS:tests/proto/%.proto=$(BUILD)/gen/%.pb-c.c)
GEN_H    := $(GEN_C:.c=.h) $(TGEN_C:.c=.h)

COMMON_SRCS := $(sort $(wildcard libcommon/*.c))
COMMON_LIB  := $(BUILD)/lib/libcommon.a
PROTO_LIB   := $(BUILD)/lib/libproto.a
TPROTO_LIB  := $(BUILD)/lib/libtestproto.a

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))

SERVICES := $(notdir $(patsubst %/,%,$(wildcard services/*/)))
SUPPORT  := $(notdir $(patsubst %/,%,$(wildcard tests/support/*/)))
TOOLS    := $(sort $(patsubst tools/%/,%,$(dir $(wildcard tools/*/*.c))))
# tools/<prog>/<prog> without C sources is a script, installed as is (upsq)
SCRIPT_TOOLS := $(filter-out $(TOOLS),$(notdir $(patsubst %/,%,$(wildcard tools/*/))))
BENCHES  := $(notdir $(patsubst %/,%,$(wildcard bench/*/)))

ALL_BINS :=
ALL_TESTS :=

# Generated sources are intermediate files to make; keep them.
.SECONDARY:

.PHONY: all asan tsan deps run stop test test-unit bench lint format clean py tests-build preflight
all:

# ---- system prerequisites ----
# Fails before anything is built, naming each missing file and the Debian package providing it.
preflight:
	@scripts/deps.sh --check
# A system file some rule needs and the machine lacks: name it and its package rather than
# make's bare "No rule to make target".
/usr/include/%:
	@scripts/deps.sh --missing $@

# ---- generated protobuf-c code (never committed) ----
$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: proto/%.proto | preflight
	@mkdir -p $(BUILD)/gen
	$(PROTOC_C) -Iproto -I/usr/include --c_out=$(BUILD)/gen $<
$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: tests/proto/%.proto | preflight
	@mkdir -p $(BUILD)/gen
	$(PROTOC_C) -Itests/proto -Iproto -I/usr/include --c_out=$(BUILD)/gen $<
$(BUILD)/gen/google/protobuf/%.pb-c.c $(BUILD)/gen/google/protobuf/%.pb-c.h: /usr/include/google/protobuf/%.proto | preflight
	@mkdir -p $(BUILD)/gen
	$(PROTOC_C) -I/usr/include --c_out=$(BUILD)/gen $<

# The FileDescriptorSet of proto/ (with what it imports), embedded in libproto as
# rpc_descriptor_set: gRPC server reflection answers from it (docs/rpc.md, "Reflection").
$(BUILD)/gen/descriptor_set.pb: $(PROTOS) | preflight
	@mkdir -p $(BUILD)/gen
	$(PROTOC) -Iproto -I/usr/include --include_imports --descriptor_set_out=$@ $(PROTOS)
$(BUILD)/gen/descriptor_set.c: $(BUILD)/gen/descriptor_set.pb
	{ echo '#include <stddef.h>'; \
	  echo 'const unsigned char rpc_descriptor_set[] = {'; \
	  od -An -v -tx1 $< | sed 's/ *\([0-9a-f][0-9a-f]\)/0x\1,/g'; \
	  echo '};'; \
	  echo 'const size_t rpc_descriptor_set_len = sizeof rpc_descriptor_set;'; } >$@.tmp && mv $@.tmp $@

# Python modules for tests that use the official grpcio client.
py: $(BUILD)/py/.stamp
$(BUILD)/py/.stamp: $(PROTOS) $(TPROTOS)
	@mkdir -p $(BUILD)/py
	$(PROTOC) -Iproto -Itests/proto -I/usr/include --python_out=$(BUILD)/py $(PROTOS) $(TPROTOS)
	@touch $@

# ---- objects ----
# Objects are rebuilt when the compiler command changes: a stamp file holds it.
FLAGS_STAMP := $(BUILD)/.cflags
FLAGS_LINE   = $(CC) $(CFLAGS) $(INCS) $(DEPFLAGS)
$(FLAGS_STAMP): FORCE
	@mkdir -p $(BUILD); echo '$(FLAGS_LINE)' | cmp -s - $@ || echo '$(FLAGS_LINE)' >$@
.PHONY: FORCE
FORCE:
$(BUILD)/obj/%.o: %.c $(FLAGS_STAMP) | preflight $(GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCS) $(DEPFLAGS) -c $< -o $@
# Generated code is not ours to lint: compile it without -Werror.
$(BUILD)/obj/gen/%.o: $(BUILD)/gen/%.c | $(GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -Werror,$(CFLAGS)) $(INCS) -c $< -o $@

$(PROTO_LIB): $(patsubst $(BUILD)/gen/%.c,$(BUILD)/obj/gen/%.o,$(GEN_C) $(BUILD)/gen/descriptor_set.c)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^
$(TPROTO_LIB): $(patsubst $(BUILD)/gen/%.c,$(BUILD)/obj/gen/%.o,$(TGEN_C))
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^
$(COMMON_LIB): $(call obj,$(COMMON_SRCS))
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

BASE_LIBS := $(COMMON_LIB) $(PROTO_LIB)

# ---- services ----
define service_tmpl
$(1)_SRCS := $$(filter-out services/$(1)/main.c,$$(sort $$(wildcard services/$(1)/*.c)))
$(1)_LIB  := $(BUILD)/lib/lib$(1).a
$$($(1)_LIB): $$(call obj,$$($(1)_SRCS))
	@mkdir -p $$(dir $$@)
	rm -f $$@ && ar rcs $$@ $$^
ifneq ($(wildcard services/$(1)/main.c),)
$(BUILD)/bin/$(1): $$(call obj,services/$(1)/main.c) $$($(1)_LIB) $$(BASE_LIBS)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS) $$(LDFLAGS) -o $$@ $$^ $$(LIBS)
ALL_BINS += $(BUILD)/bin/$(1)
endif
$(1)_UNIT := $$(patsubst tests/unit/$(1)/%.c,$(BUILD)/tests/unit/$(1)_%,$$(wildcard tests/unit/$(1)/test_*.c))
$(BUILD)/tests/unit/$(1)_%: $$(call obj,tests/unit/$(1)/%.c) $$($(1)_LIB) $$(BASE_LIBS)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS) $$(LDFLAGS) -o $$@ $$^ $$(LIBS) -lcmocka
ALL_TESTS += $$($(1)_UNIT)
endef
$(foreach s,$(SERVICES),$(eval $(call service_tmpl,$(s))))

# ---- test support programs and benchmarks ----
define prog_tmpl
$(BUILD)/bin/$(2): $$(call obj,$$(sort $$(wildcard $(1)/$(2)/*.c))) $(TPROTO_LIB) $$(BASE_LIBS)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS) $$(LDFLAGS) -o $$@ $$^ $$(LIBS)
ALL_TESTS += $(BUILD)/bin/$(2)
endef
$(foreach p,$(SUPPORT),$(eval $(call prog_tmpl,tests/support,$(p))))
$(foreach p,$(BENCHES),$(eval $(call prog_tmpl,bench,$(p))))
$(foreach p,$(TOOLS),$(eval $(call prog_tmpl,tools,$(p))))
ALL_BINS += $(TOOLS:%=$(BUILD)/bin/%)
define script_tmpl
$(BUILD)/bin/$(1): tools/$(1)/$(1)
	@mkdir -p $$(dir $$@)
	ln -sf $$(abspath $$<) $$@
endef
$(foreach p,$(SCRIPT_TOOLS),$(eval $(call script_tmpl,$(p))))
ALL_BINS += $(SCRIPT_TOOLS:%=$(BUILD)/bin/%)

# ---- tests ----
UNIT_C := $(wildcard tests/unit/test_*.c)
INTEG_C := $(wildcard tests/integration/test_*.c)
UNIT_BINS := $(UNIT_C:tests/unit/%.c=$(BUILD)/tests/unit/%)
INTEG_BINS := $(INTEG_C:tests/integration/%.c=$(BUILD)/tests/integration/%)
$(BUILD)/tests/unit/%: $(BUILD)/obj/tests/unit/%.o $(TPROTO_LIB) $(BASE_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $^ $(LIBS) -lcmocka
$(BUILD)/tests/integration/%: $(BUILD)/obj/tests/integration/%.o $(TPROTO_LIB) $(BASE_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $^ $(LIBS) -lcmocka
ALL_TESTS += $(UNIT_BINS) $(INTEG_BINS)

-include $(wildcard services/*/service.mk tests/*/tests.mk)

all: $(ALL_BINS)
tests-build: all $(ALL_TESTS) py

asan:
	$(MAKE) BUILD=build-asan SAN=1 all

# ThreadSanitizer build of every test program into build-tsan/ (scripts/test.sh runs them)
tsan:
	$(MAKE) BUILD=build-tsan SAN=thread tests-build

deps:
	@scripts/deps.sh

run: deps all py
	@scripts/runtime.sh up

stop:
	@scripts/runtime.sh down

test: deps tests-build
	@scripts/test.sh

bench: deps all tests-build
	@scripts/bench.sh

FORMAT_SRCS = $(shell git ls-files '*.c' '*.h' 2>/dev/null)
lint:
	@out=$$(clang-format --dry-run --Werror $(FORMAT_SRCS) 2>&1); \
	 if [ -n "$$out" ]; then echo "$$out" | head -40; echo "lint: run 'make format'"; exit 1; fi; \
	 echo "lint: $(words $(FORMAT_SRCS)) files formatted"
format:
	clang-format -i $(FORMAT_SRCS)

clean:
	rm -rf build build-asan

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
