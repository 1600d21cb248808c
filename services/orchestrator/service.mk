# orchestrator: programs outside services/ that need the service library (agent definitions,
# key encryption, the store).
#   tools/upsquad-agents -> $(BUILD)/bin/upsquad-agents   operator tool: agents and BYOK keys
$(BUILD)/bin/upsquad-agents: $(orchestrator_LIB)
$(BUILD)/obj/tools/upsquad-agents/main.o: INCS += -Iservices/orchestrator
# the service library needs libproto/libcommon after it on the link line
$(BUILD)/bin/upsquad-agents: LIBS := $(PROTO_LIB) $(COMMON_LIB) $(LIBS)
# ListChildren's page tokens are the workflow-engine's signed keyset tokens (one copy of the
# code: services/workflow-engine/pagetok.c, archived into this library too).
$(orchestrator_LIB): $(BUILD)/obj/services/workflow-engine/pagetok.o
$(BUILD)/obj/services/orchestrator/tree.o: INCS += -Iservices/workflow-engine
