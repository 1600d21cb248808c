# orchestrator: programs outside services/ that need the service library (agent definitions,
# key encryption, the store).
#   tools/upsquad-agents -> $(BUILD)/bin/upsquad-agents   operator tool: agents and BYOK keys
$(BUILD)/bin/upsquad-agents: $(orchestrator_LIB)
$(BUILD)/obj/tools/upsquad-agents/main.o: INCS += -Iservices/orchestrator
# the service library needs libproto/libcommon after it on the link line
$(BUILD)/bin/upsquad-agents: LIBS := $(PROTO_LIB) $(COMMON_LIB) $(LIBS)
