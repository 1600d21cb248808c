# workflow-engine: programs outside services/ that need the service library. The generic rules
# build tools/<prog> and bench/<prog> against libcommon only; these lines add the library as a
# further prerequisite, which the generic recipe links after the program's own objects.
#   tools/defn-validate -> $(BUILD)/bin/defn-validate   definition checker (conformance tests, authors)
#   bench/defn          -> $(BUILD)/bin/defn            validation benchmark (bench/defn/bench.sh)
$(BUILD)/bin/defn-validate: $(workflow-engine_LIB)
$(BUILD)/bin/defn: $(workflow-engine_LIB)
