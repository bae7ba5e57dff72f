#!/bin/bash
# The command of a Spark executor pod (k8s/components/spark-k8s, executor-pod.yaml).
#
# Spark on Kubernetes starts an executor's container with the one argument "executor"
# and its settings in SPARK_* variables (the driver's URL, the executor's id, cores,
# heap, the application id, the pod's IP and name; its JVM options as SPARK_JAVA_OPT_0,
# SPARK_JAVA_OPT_1, ...). Spark's own images turn these into the JVM's command line in
# their entrypoint; this image has no such entrypoint, so this script is it: the JVM of
# pyspark's jars, the executor backend for Kubernetes, nothing else. No Ray here: the
# subtasks reach the coordinator over its endpoint.
set -euo pipefail

if [ "${1:-}" != executor ]; then
  echo "executor.sh: Spark on Kubernetes runs this with the argument 'executor', got: $*" >&2
  exit 2
fi
for name in SPARK_DRIVER_URL SPARK_EXECUTOR_ID SPARK_EXECUTOR_CORES SPARK_EXECUTOR_MEMORY \
  SPARK_APPLICATION_ID SPARK_EXECUTOR_POD_IP SPARK_RESOURCE_PROFILE_ID SPARK_EXECUTOR_POD_NAME; do
  if [ -z "${!name:-}" ]; then
    echo "executor.sh: $name is not set: is this pod an executor Spark created?" >&2
    exit 2
  fi
done
# pyspark's own Spark (its jars include the Kubernetes backend), unless SPARK_HOME says.
spark_home=${SPARK_HOME:-$(python3 -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')}

# The JVM options in the order of their index (SPARK_JAVA_OPT_<n>), each one argument.
java_opts=()
while IFS= read -r index; do
  var="SPARK_JAVA_OPT_$index"
  java_opts+=("${!var}")
done < <(compgen -e | sed -n 's/^SPARK_JAVA_OPT_\([0-9][0-9]*\)$/\1/p' | sort -n)

exec java "${java_opts[@]}" \
  -Xms"$SPARK_EXECUTOR_MEMORY" -Xmx"$SPARK_EXECUTOR_MEMORY" \
  -cp "$spark_home/jars/*" \
  org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
  --driver-url "$SPARK_DRIVER_URL" \
  --executor-id "$SPARK_EXECUTOR_ID" \
  --cores "$SPARK_EXECUTOR_CORES" \
  --app-id "$SPARK_APPLICATION_ID" \
  --hostname "$SPARK_EXECUTOR_POD_IP" \
  --resourceProfileId "$SPARK_RESOURCE_PROFILE_ID" \
  --podName "$SPARK_EXECUTOR_POD_NAME"
