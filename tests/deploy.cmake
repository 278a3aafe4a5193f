# Deployment tests: `tandem up/down/status`, `tandem bench` and deploy/start-*.sh with real
# processes (tests/deploy/test_deploy.py; synthetic model, random ports, temp run dirs).
#   deploy_up_down     up -d -> status running -> HTTP request -> down -> status stopped
#   deploy_foreground  foreground up stopped by SIGTERM; a killed rank stops the cluster
#   deploy_bad_model   a decode instance that cannot start (missing model, backend cuda without
#                      a GPU): up -d fails naming the reason, nothing left behind
#   deploy_bench       tandem bench --json (plain and --stream) against the cluster
#   deploy_netns       router and decode instance in two network namespaces (needs root;
#                      skipped otherwise)
#   deploy_prefill_up_down, deploy_prefill_foreground, deploy_prefill_scripts: the same
#                      with a prefill instance (pp 2): up/down/status, readiness, a killed
#                      stage, a stage that cannot start, deploy/start-prefill.sh (skipped
#                      without the tandem-prefill target)
#   deploy_secure      the YAML's security section: mutual TLS on every control socket of
#                      a disaggregated cluster (router, stages, decode, up's probe, tandem
#                      client --tls-*), a request served; no certificate / another CA's:
#                      no answer, refusals logged; a missing file stops up naming it; UCX on
#                      the loopback device only (skipped without openssl or tandem-prefill)
# Without the tandem-router target, tests/deploy/fake_router.py stands in for the router.
#   deploy_quickstart  a new user's first minutes (tests/deploy/test_quickstart.py): a copy of
#                      the working tree without build directory, scripts/run.sh --port N
#                      (setup, its own Release build, the default cluster on the default
#                      model), the printed and README examples, the openai client, busy ports
#                      and --reprofile, Ctrl-C, nothing left. Needs TANDEM_MODEL (setup.sh
#                      has fetched the model and the venv); RUN_SERIAL: it builds and runs a
#                      whole cluster (about 1.5 min on 2 cores)
#   deploy_bench_multiturn_smoke  tools/bench_multiturn.py --smoke (the issue 16 multi-turn
#                      benchmark, kept out of CI, so that it cannot rot): one round of its five
#                      clusters (`tandem up -d`) on the synthetic model, 2 conversations x 3
#                      turns; every turn answered, cached_tokens 0 with the caches off and > 0
#                      on turns 2+ with them on (about 15 s)
if(TANDEM_PYTHON)
  foreach(case up_down foreground bad_model bench netns prefill_up_down prefill_foreground
               prefill_scripts secure)
    add_test(NAME deploy_${case}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/deploy/test_deploy.py
                     --case ${case} --tandem $<TARGET_FILE:tandem>
                     --decode $<TARGET_FILE:tandem-decode> --router $<TARGET_FILE:tandem-router>
                     --prefill $<TARGET_FILE:tandem-prefill>
                     --synth-dir ${TANDEM_TEST_DATA}/synth --source-dir ${CMAKE_SOURCE_DIR})
    set_tests_properties(deploy_${case} PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 400
                         SKIP_RETURN_CODE 77)
  endforeach()
endif()

# Run-time membership (tests/deploy/test_membership.py, router.membership):
#   deploy_membership_decode   under streaming load: a decode instance joins and takes
#                      requests, a YAML instance drains on SIGTERM (none of its requests
#                      moves), a refused join (max_instances) gets in once a killed member is
#                      forgotten, a member restarted at another port is followed; 0 failures
#   deploy_membership_prefill  a prefill instance joins and prefills, the YAML's leaves
#   deploy_membership_netns    four hosts (network namespaces: router, two decode, one
#                      prefill), every address a name from the namespace's /etc/hosts, the
#                      YAML's entries templates only, https + API key + mutual TLS + keyed KV:
#                      one decode host joins under load, the other leaves drained, the KV
#                      crosses hosts; requests without the credentials refused and logged at
#                      the router and a decode host (needs root and openssl; skipped otherwise)
if(TANDEM_PYTHON)
  foreach(case decode prefill netns)
    add_test(NAME deploy_membership_${case}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/deploy/test_membership.py
                     --case ${case} --decode $<TARGET_FILE:tandem-decode>
                     --router $<TARGET_FILE:tandem-router>
                     --prefill $<TARGET_FILE:tandem-prefill> --tandem $<TARGET_FILE:tandem>
                     --model ${TANDEM_TEST_DATA}/synth/llama.gguf)
    set_tests_properties(deploy_membership_${case} PROPERTIES FIXTURES_REQUIRED synth_models
                         TIMEOUT 400 SKIP_RETURN_CODE 77)
  endforeach()
endif()

if(TANDEM_PYTHON)
  add_test(NAME deploy_bench_multiturn_smoke
           COMMAND ${TANDEM_PYTHON} ${CMAKE_SOURCE_DIR}/tools/bench_multiturn.py --smoke
                   --build ${CMAKE_BINARY_DIR} --model ${TANDEM_TEST_DATA}/synth/llama.gguf
                   --configs pd_on,pd_off,co_aware,co_load,co_off,co_rr)
  set_tests_properties(deploy_bench_multiturn_smoke PROPERTIES FIXTURES_REQUIRED synth_models
                       TIMEOUT 300)
endif()

if(TANDEM_PYTHON AND TANDEM_MODEL)
  add_test(NAME deploy_quickstart
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/deploy/test_quickstart.py
                   --source-dir ${CMAKE_SOURCE_DIR})
  set_tests_properties(deploy_quickstart PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE)
endif()

# deploy_k8s_render, deploy_k8s_errors, deploy_k8s_health (tests/deploy/test_k8s.py):
# `tandem k8s render` of the example clusters and of a YAML with every rewritten key, each
# manifest checked against the Kubernetes 1.30 API schemas, strict (kubernetes-validate, in
# the test venv: its schemas are in the package, nothing is fetched), plus the render's own
# rules (the ConfigMap's YAML loads and renders to itself, one container per rank and stage
# with the node command lines, probes, resources from the model's header); bad input and
# options; `tandem health` against a real decode instance (the manifests' exec probes); a
# data-parallel group rendered into one pod and that pod's rendered command lines run here
# (the members form their group, join the router through membership, both serve)
if(TANDEM_PYTHON)
  foreach(case render errors health dp_pod)
    add_test(NAME deploy_k8s_${case}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/deploy/test_k8s.py
                     --case ${case} --tandem $<TARGET_FILE:tandem>
                     --decode $<TARGET_FILE:tandem-decode>
                     --router $<TARGET_FILE:tandem-router>
                     --synth-dir ${TANDEM_TEST_DATA}/synth --source-dir ${CMAKE_SOURCE_DIR})
    set_tests_properties(deploy_k8s_${case} PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300
                         SKIP_RETURN_CODE 77 ENVIRONMENT PYTHONDONTWRITEBYTECODE=1)
  endforeach()
endif()
