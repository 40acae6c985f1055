#!/bin/bash
# DiLoCoX GPT pretraining under SLURM: one Megatron (torchrun) world per cluster, the clusters meeting
# only at the DiLoCoX rendezvous (cluster 0's first node). Submit from the repository root (or set
# DILOCOX_REPO / PYTHON); relative paths are relative to the submission directory.
#
# Mode 1 -- one allocation, C clusters (default; DILOCOX_NUM_CLUSTERS=C, default 2):
#     DILOCOX_NUM_CLUSTERS=2 sbatch --nodes=8 scripts/pretrain_gpt_dilocox.sh [extra Megatron flags]
#   The job's nodes are split into C contiguous blocks of nodes/C nodes; block k is cluster k, its own
#   torchrun world (MASTER_ADDR = first node of the block). The rendezvous store runs on the job's
#   first node. Ports derive from SLURM_JOB_ID (override with DILOCOX_PORT_BASE). The shared secret is
#   generated for the job unless DILOCOX_SECRET is set; it travels in the environment only.
#
# Mode 2 -- one job per cluster (DILOCOX_MODE=multi-job), e.g. on independent schedulers at C sites.
#   Every site submits this same script with, in its environment:
#     DILOCOX_MODE=multi-job DILOCOX_NUM_CLUSTERS=C DILOCOX_CLUSTER_ID=k (0..C-1)
#     DILOCOX_RENDEZVOUS=HOST:PORT   (cluster 0's FIRST node, reachable from every site; pin cluster 0's
#                                     first node with sbatch --nodelist, the store listens on PORT there)
#     DILOCOX_SECRET=...             (the same value at every site; export it, never pass it as a flag)
#   All the job's nodes form one torchrun world (cluster k).
#
# Either mode with a standalone coordinator (DILOCOX_COORDINATOR=standalone): start
#     DILOCOX_SECRET=... python -m megatron_dilocox.coordinator --listen HOST:PORT
#   on a host every cluster reaches (login node, small VM, its own SLURM job) and set
#   DILOCOX_RENDEZVOUS=HOST:PORT (or HOST:PORT,HOST2:PORT2 with a --standby second) and DILOCOX_SECRET for
#   every job. No cluster hosts anything then, and any cluster (cluster 0 included) may be lost.
#
# Both modes: GPUs, partition, nodes, time come from the #SBATCH defaults below and are overridden on the
# sbatch command line (sbatch -p gpu --gpus-per-node=4 -N 16 ...). On a node without a GPU the script
# runs on CPU (gloo, plus the flags megatron_dilocox.glue.cpu_backend.CPU_FLAGS); with GPUs it starts one
# process per GPU (CUDA_VISIBLE_DEVICES, else nvidia-smi; NPROC_PER_NODE overrides either).
# Per-cluster data: DATA_PREFIX contains "{cluster}", replaced by the cluster id; "{cluster}" is replaced
# in every Megatron flag, including the ones passed through "$@" (extra flags come last and win).
#
#SBATCH --job-name=dilocox-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

# ------------------------------------------------------------------------------ edit these
DATA_PREFIX=${DATA_PREFIX:-"data/kjv/train_c{cluster}_text_document"}  # Megatron indexed dataset, per cluster
VALID_DATA_PREFIX=${VALID_DATA_PREFIX:-data/kjv/valid_text_document}  # empty: no validation set
TOKENIZER_TYPE=${TOKENIZER_TYPE:-SentencePieceTokenizer}             # Megatron --tokenizer-type
TOKENIZER_MODEL=${TOKENIZER_MODEL:-data/kjv/tokenizer.model}          # file or directory
CHECKPOINT_DIR=${CHECKPOINT_DIR:-}             # empty: no --save/--load; else DIR/cluster{cluster}
LOG_DIR=${LOG_DIR:-logs/dilocox-${SLURM_JOB_ID:-local}}  # DiLoCoX per-round metrics (JSONL per cluster)
TP=${TP:-1}                                    # tensor parallel size (multi-job: per site, with
PP=${PP:-1}                                    # pipeline parallel size   --dilocox-exchange-layout canonical)
DILOCOX_H=${DILOCOX_H:-125}                    # inner steps per outer round
DILOCOX_NUM_CLUSTERS=${DILOCOX_NUM_CLUSTERS:-2}
DILOCOX_MODE=${DILOCOX_MODE:-single}           # single (one allocation, C blocks) or multi-job
DILOCOX_COORDINATOR=${DILOCOX_COORDINATOR:-embedded}  # embedded (cluster 0 hosts the rendezvous) or standalone
# -------------------------------------------------------------------------------------------

PROG=pretrain_gpt_dilocox.sh
die() { echo "$PROG: error: $*" >&2; exit 2; }
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

# ---- checks that need nothing but the environment (fast, before any Python or srun)
case "$DILOCOX_MODE" in
  single|one-allocation) DILOCOX_MODE=single ;;
  multi-job) ;;
  *) die "DILOCOX_MODE must be 'single' (one allocation split into clusters) or 'multi-job', got '$DILOCOX_MODE'" ;;
esac
case "$DILOCOX_COORDINATOR" in
  embedded|standalone) ;;
  *) die "DILOCOX_COORDINATOR must be 'embedded' (cluster 0 hosts the rendezvous) or 'standalone'" \
         "(python -m megatron_dilocox.coordinator), got '$DILOCOX_COORDINATOR'" ;;
esac
if [ "$DILOCOX_COORDINATOR" = standalone ]; then
  [[ "${DILOCOX_RENDEZVOUS:-}" =~ ^[^:,]+:[0-9]+(,[^:,]+:[0-9]+)*$ ]] \
    || die "DILOCOX_COORDINATOR=standalone: set DILOCOX_RENDEZVOUS=HOST:PORT of" \
           "'python -m megatron_dilocox.coordinator --listen HOST:PORT' (got '${DILOCOX_RENDEZVOUS:-}')"
  [ -n "${DILOCOX_SECRET:-}" ] || die "DILOCOX_COORDINATOR=standalone: export DILOCOX_SECRET (the coordinator's" \
    "and every cluster's shared secret; environment only)"
fi
C=$DILOCOX_NUM_CLUSTERS
if ! is_int "$C" || [ "$C" -lt 1 ]; then
  die "DILOCOX_NUM_CLUSTERS must be an integer >= 1, got '$C'"
fi
C=$((10#$C))
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
[ -n "$NNODES" ] || die "not inside a SLURM job (SLURM_JOB_NUM_NODES unset): submit with sbatch"
is_int "$NNODES" && [ "$NNODES" -ge 1 ] || die "SLURM_JOB_NUM_NODES must be a positive integer, got '$NNODES'"
NNODES=$((10#$NNODES))

if [ "$DILOCOX_MODE" = single ]; then
  if [ $((NNODES % C)) -ne 0 ]; then
    die "the job has $NNODES nodes, which does not split into DILOCOX_NUM_CLUSTERS=$C equal clusters:" \
        "submit with sbatch --nodes=<a multiple of $C> or change DILOCOX_NUM_CLUSTERS"
  fi
  NODES_PER_CLUSTER=$((NNODES / C))
  CLUSTER_BASE=0
  CLUSTER_IDS=$(seq 0 $((C - 1)))
else
  NODES_PER_CLUSTER=$NNODES
  CLUSTER_BASE=${DILOCOX_CLUSTER_ID:-}
  is_int "$CLUSTER_BASE" && [ "$CLUSTER_BASE" -lt "$C" ] \
    || die "multi-job mode: set DILOCOX_CLUSTER_ID to this site's cluster id, 0..$((C - 1)) (got '${CLUSTER_BASE}')"
  CLUSTER_IDS=$CLUSTER_BASE
  if [ "$C" -gt 1 ]; then
    [ -n "${DILOCOX_RENDEZVOUS:-}" ] || die "multi-job mode: set DILOCOX_RENDEZVOUS=HOST:PORT, the address of" \
      "cluster 0's first node (the same value at every site)"
    [[ "$DILOCOX_RENDEZVOUS" =~ ^[^:]+:[0-9]+$ ]] || [ "$DILOCOX_COORDINATOR" = standalone ] \
      || die "multi-job mode: DILOCOX_RENDEZVOUS must be HOST:PORT, got '$DILOCOX_RENDEZVOUS'"
    [ -n "${DILOCOX_SECRET:-}" ] || die "multi-job mode: export DILOCOX_SECRET (the same shared secret at every" \
      "site; environment only, never a command-line flag)"
  fi
fi

for k in $CLUSTER_IDS; do
  prefix=${DATA_PREFIX//\{cluster\}/$k}
  for ext in bin idx; do
    [ -f "$prefix.$ext" ] || die "training data for cluster $k not found: $prefix.$ext (from DATA_PREFIX='$DATA_PREFIX'," \
      "cwd $(pwd)): set DATA_PREFIX to your Megatron indexed dataset prefix, with {cluster} for the cluster id"
  done
done
if [ -n "$VALID_DATA_PREFIX" ]; then
  for ext in bin idx; do
    [ -f "${VALID_DATA_PREFIX//\{cluster\}/$CLUSTER_BASE}.$ext" ] \
      || die "validation data not found: ${VALID_DATA_PREFIX}.$ext: set VALID_DATA_PREFIX (or empty for none)"
  done
fi
[ -e "$TOKENIZER_MODEL" ] || die "tokenizer model not found: $TOKENIZER_MODEL: set TOKENIZER_MODEL"
if [ "$C" -gt 1 ] && [[ "$DATA_PREFIX" != *"{cluster}"* ]]; then
  echo "$PROG: warning: DATA_PREFIX has no {cluster}: every cluster reads the same data" >&2
fi

# ---- the Python that has megatron_dilocox installed
if [ -z "${DILOCOX_REPO:-}" ]; then
  here=$(cd "$(dirname "$0")/.." 2>/dev/null && pwd || true)
  if [ -n "$here" ] && [ -d "$here/megatron_dilocox" ]; then DILOCOX_REPO=$here
  else DILOCOX_REPO=${SLURM_SUBMIT_DIR:-$(pwd)}; fi  # sbatch runs a copy of this file from its spool dir
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$DILOCOX_REPO/.venv/bin/python" ]; then PYTHON=$DILOCOX_REPO/.venv/bin/python; else PYTHON=python3; fi
fi

# ---- GPUs on this (the first) node; every node of the job is assumed alike
gpus_on_node() {
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then echo 0; return; fi
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    local -a v; IFS=, read -r -a v <<<"$CUDA_VISIBLE_DEVICES"; echo "${#v[@]}"
  else
    nvidia-smi -L | grep -c '^GPU'
  fi
}
NGPUS=$(gpus_on_node)
if [ "$NGPUS" -gt 0 ]; then
  NPROC=${NPROC_PER_NODE:-$NGPUS}
  DEVICE_ARGS=(--bf16)
else
  NPROC=${NPROC_PER_NODE:-1}
  mapfile -t DEVICE_ARGS < <("$PYTHON" -c \
    'from megatron_dilocox.glue.cpu_backend import CPU_FLAGS; print("\n".join(CPU_FLAGS))') \
    || die "cannot import megatron_dilocox with $PYTHON: set PYTHON or DILOCOX_REPO"
  [ "${#DEVICE_ARGS[@]}" -gt 0 ] || die "cannot read CPU_FLAGS with $PYTHON: set PYTHON or DILOCOX_REPO"
fi

# ---- nodes, ports, secret
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[ "${#NODES[@]}" -eq "$NNODES" ] || die "scontrol show hostnames gave ${#NODES[@]} nodes for '$SLURM_JOB_NODELIST', expected $NNODES"
# rendezvous = base, cluster block b = base + 1 + b; different jobs sharing a host get different ports, all
# below Linux's default ephemeral range (32768-60999): a derived port there could already be the local end of
# some outgoing connection on the node (torchrun then stops with EADDRINUSE)
PORT_BASE=${DILOCOX_PORT_BASE:-$((15000 + (SLURM_JOB_ID * (C + 1)) % (32768 - 15000 - C - 1)))}
if [ "$DILOCOX_MODE" = single ] && [ "$DILOCOX_COORDINATOR" = embedded ]; then
  DILOCOX_RENDEZVOUS=${NODES[0]}:$PORT_BASE
  if [ -z "${DILOCOX_SECRET:-}" ]; then
    DILOCOX_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  fi
fi
export DILOCOX_SECRET  # environment only: srun passes it on, no command line carries it

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$LOG_DIR"

# ------------------------------------------------------------------------------ Megatron arguments
MODEL_ARGS=(
  --num-layers 12
  --hidden-size 768
  --num-attention-heads 12
  --seq-length 1024
  --max-position-embeddings 1024
  --position-embedding-type rope
  --attention-dropout 0.0
  --hidden-dropout 0.0
)
TRAINING_ARGS=(
  --micro-batch-size 4
  --global-batch-size 64
  --train-iters 20000
  --lr 3e-4
  --min-lr 3e-5
  --lr-decay-style cosine
  --lr-warmup-iters 500
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.95
  --clip-grad 1.0
  --init-method-std 0.02
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --seed 1234
  "${DEVICE_ARGS[@]}"
)
DATA_ARGS=(
  --tokenizer-type "$TOKENIZER_TYPE"
  --tokenizer-model "$TOKENIZER_MODEL"
  --train-data-path "$DATA_PREFIX"
)
[ -z "$VALID_DATA_PREFIX" ] || DATA_ARGS+=(--valid-data-path "$VALID_DATA_PREFIX")
LOGGING_ARGS=(
  --log-interval 10
  --eval-interval 1000
  --eval-iters 10
)
[ -z "$CHECKPOINT_DIR" ] || LOGGING_ARGS+=(--save "$CHECKPOINT_DIR/cluster{cluster}"
                                          --load "$CHECKPOINT_DIR/cluster{cluster}" --save-interval 1000)
DILOCOX_ARGS=(
  --dilocox
  --dilocox-num-clusters "$C"
  --dilocox-h "$DILOCOX_H"
  --dilocox-metrics-file "$LOG_DIR/dilocox_metrics_c{cluster}.jsonl"
)
[ "$C" -eq 1 ] || DILOCOX_ARGS+=(--dilocox-rendezvous "$DILOCOX_RENDEZVOUS")
[ "$C" -eq 1 ] || [ "$DILOCOX_COORDINATOR" = embedded ] || DILOCOX_ARGS+=(--dilocox-coordinator standalone)
# (--dilocox-cluster-id is added per node below)

# ------------------------------------------------------------------------------ launch
# One srun task per node. Each task finds its block (cluster), its rank inside the block and the
# block's first node, substitutes {cluster} and starts torchrun for its cluster's world.
# shellcheck disable=SC2016  # expanded by the task on each node, not here
TASK='
set -euo pipefail
read -r -a nodes <<<"$DX_NODES"
me=-1
for i in "${!nodes[@]}"; do [ "${nodes[$i]}" = "${SLURMD_NODENAME:-}" ] && me=$i; done
[ "$me" -ge 0 ] || me=$SLURM_NODEID
block=$(( me / DX_NODES_PER_CLUSTER ))
cluster=$(( DX_CLUSTER_BASE + block ))
node_rank=$(( me % DX_NODES_PER_CLUSTER ))
master=${nodes[$(( block * DX_NODES_PER_CLUSTER ))]}
port=$(( DX_PORT_BASE + 1 + block ))
args=()
for a in "$@"; do args+=("${a//\{cluster\}/$cluster}"); done
echo "[dilocox-launch] node ${nodes[$me]}: cluster $cluster, node $node_rank of $DX_NODES_PER_CLUSTER," \
     "$DX_NPROC proc/node, master ${master}:${port}"
exec "$DX_PYTHON" -m torch.distributed.run --nproc-per-node "$DX_NPROC" --nnodes "$DX_NODES_PER_CLUSTER" \
  --node-rank "$node_rank" --master-addr "$master" --master-port "$port" \
  -m megatron_dilocox.pretrain_gpt "${args[@]}" --dilocox-cluster-id "$cluster"
'
export DX_NODES="${NODES[*]}" DX_NODES_PER_CLUSTER=$NODES_PER_CLUSTER DX_CLUSTER_BASE=$CLUSTER_BASE \
       DX_PORT_BASE=$PORT_BASE DX_NPROC=$NPROC DX_PYTHON=$PYTHON

echo "[dilocox-launch] job ${SLURM_JOB_ID}: mode $DILOCOX_MODE, $C cluster(s) in total," \
     "$((NNODES / NODES_PER_CLUSTER)) here (id $CLUSTER_BASE..$((CLUSTER_BASE + NNODES / NODES_PER_CLUSTER - 1)))," \
     "$NODES_PER_CLUSTER node(s) x $NPROC proc each ($([ "$NGPUS" -gt 0 ] && echo "$NGPUS GPU/node" || echo CPU, gloo))," \
     "rendezvous ${DILOCOX_RENDEZVOUS:-none}, nodes ${NODES[*]}"

if [ "$DILOCOX_MODE" = multi-job ] && [ "$CLUSTER_BASE" -eq 0 ] && [ "$C" -gt 1 ] \
    && [ "$DILOCOX_COORDINATOR" = embedded ]; then
  echo "[dilocox-launch] cluster 0 hosts the rendezvous store on ${NODES[0]}, port ${DILOCOX_RENDEZVOUS##*:}:" \
       "DILOCOX_RENDEZVOUS=$DILOCOX_RENDEZVOUS must reach that node from every site"
fi

SRUN_ARGS=(--nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --label)
[ -z "${SLURM_CPUS_ON_NODE:-}" ] || SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_ON_NODE")
set +e
srun "${SRUN_ARGS[@]}" bash -c "$TASK" dilocox-task \
  "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "${DILOCOX_ARGS[@]}" "$@"
rc=$?
set -e
echo "[dilocox-launch] job ${SLURM_JOB_ID}: srun exited with $rc"
exit $rc
