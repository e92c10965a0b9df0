"""Megatron-LM flags that tpzoo refuses: a launch line copied from Megatron-LM stops at the first one
with one line saying why (exit status 2, before torch loads), instead of the flag being accepted and
ignored. docs/megatron.md lists every Megatron-LM flag as supported or refused."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn, Sequence

# why tpzoo does not support them (one clause) -> Megatron-LM flags, those of an area sharing their reason
_BY_REASON: dict[str, str] = {
    "tpzoo shards weights over the tp group only": "--tensor-parallel-num-weight-shards",
    "tpzoo's pipeline sends use the process group's backend": "--pipeline-model-parallel-comm-backend",
    "tpzoo has no context parallelism (its mesh is pp x dp x tp)":
        "--context-parallel-size --hierarchical-context-parallel-sizes --max-seqlen-per-dp-cp-rank --cp-comm-type",
    "tpzoo has no Mamba or hybrid models":
        "--hybrid-context-parallel --enable-mhc-connections --mhc-num-residual-streams --mhc-sinkhorn-iterations "
        "--mhc-init-gating-factor --mhc-recompute-layer-num --is-hybrid-model --mamba-state-dim --mamba-head-dim "
        "--mamba-num-groups --mamba-num-heads --gdp-num-householder --disable-mamba-mem-eff-path "
        "--gdp-cutedsl-kernel --gdp-num-chunk-states-to-recompute --mamba-training-ssm-states-dtype --spec "
        "--hybrid-layer-pattern --hybrid-override-pattern",
    "tpzoo's mixtures of experts (--model mixtral) have no such option yet":
        "--expert-model-parallel-size --expert-tensor-parallel-size --expert-tensor-parallel-num-weight-shards "
        "--overlap-moe-expert-parallel-comm --overlap-dispatch-backward-with-experts-wgrad "
        "--ep-overlap-early-attn-memory-release --high-priority-a2a-comm-stream "
        "--moe-shared-expert-intermediate-size --moe-shared-expert-gate --moe-shared-expert-overlap "
        "--use-grouped-gemm-for-shared-expert --moe-shared-expert-glu-interleave-size "
        "--moe-enable-routing-replay --moe-router-padding-for-quantization "
        "--moe-router-padding-for-fp8 --moe-router-num-groups --moe-router-group-topk --moe-router-pre-softmax "
        "--moe-router-topk-scaling-factor --moe-router-score-function --moe-router-dtype "
        "--moe-router-enable-expert-bias --moe-router-bias-update-rate --moe-router-quantile-balancing-ema "
        "--moe-router-force-load-balancing --moe-router-force-biased --use-grouped-gemm-for-dense-mlp "
        "--moe-grouped-gemm --moe-use-grouped-tensor --moe-single-grouped-weight --moe-single-grouped-bias "
        "--moe-input-jitter-eps --moe-token-dispatcher-type --moe-enable-deepep "
        "--moe-flex-dispatcher-backend --moe-permute-fusion-into-hybridep --moe-hybridep-pad-uneven-dispatch-inputs "
        "--moe-per-layer-logging --moe-expert-capacity-factor --moe-pad-expert-input-to-capacity "
        "--moe-pad-experts-for-cuda-graph-inference --moe-token-drop-policy --moe-layer-recompute "
        "--moe-permute-fusion --moe-router-fusion --moe-apply-probs-on-input --moe-latent-size "
        "--gtp-remat-opt-in-modules --moe-flex-dispatcher-num-sms --moe-deepep-num-sms --moe-hybridep-num-sms "
        "--moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute --moe-hybridep-num-sms-preprocessing "
        "--moe-ncclep-zero-copy --moe-dispatch-fwd-dtype --moe-combine-bwd-dtype --moe-mlp-glu-interleave-size "
        "--moe-expert-rank-capacity-factor --moe-paged-stash --moe-paged-stash-page-size "
        "--moe-paged-stash-buffer-size-factor-cuda --moe-paged-stash-buffer-size-factor-cpu "
        "--save-tokens-per-expert-interval --gtp-remat-reduce-scatter-with-fp32-accumulation --gtp-remat-nccl-ub "
        "--gtp-expert-remat-nccl-ub --moe-layer-freq --moe-use-upcycling "
        "--moe-router-load-balancing-type --moe-upcycling-granularity --moe-routing-trace-path "
        "--moe-routing-trace-max-training-iters --moe-routing-trace-capture-logits "
        "--moe-routing-trace-capture-hidden-states --moe-routing-trace-dump-weights",
    "tpzoo initializes every model it builds (load weights with --load or --finetune)": "--no-initialization",
    "tpzoo initializes each rank's shard on its own device": "--use-cpu-initialization",
    "tpzoo has no switch for deterministic kernels": "--deterministic-mode",
    "tpzoo's layers are its own PyTorch modules, without Transformer Engine":
        "--tp-comm-overlap --no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad "
        "--disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag --no-tp-comm-overlap-rs "
        "--disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag --disable-tp-comm-split-ag "
        "--no-tp-comm-split-rs --disable-tp-comm-split-rs --cross-entropy-fusion-impl --tp-comm-bootstrap-backend "
        "--delay-wgrad-compute --defer-embedding-wgrad-compute --wgrad-deferral-limit "
        "--use-fused-weighted-squared-relu --fused-residual-rmsnorm --use-transformer-engine-op-fuser "
        "--use-te-activation-func --transformer-impl --tp-comm-overlap-cfg --te-rng-tracker --fp4-param-gather "
        "--fp8-param-gather --te-precision-config-file",
    "tpzoo's vocab-parallel cross entropy has no fused variant": "--cross-entropy-loss-fusion",
    "tpzoo's pipeline communication and schedules are torch.distributed.pipelining's (--pipeline-schedule)":
        "--use-ring-exchange-p2p --overlap-p2p-communication-warmup-flush "
        "--microbatch-group-size-per-virtual-pipeline-stage --no-overlap-p2p-communication",
    "tpzoo has no multi-token prediction":
        "--mtp-standalone --mtp-num-layers --mtp-loss-scaling-factor --mtp-use-repeated-layer --mtp-detach-heads "
        "--mtp-hsm --mtp-hybrid-override-pattern",
    "tpzoo offloads nothing to the CPU":
        "--cpu-offloading-num-layers --cpu-offloading-retain-pinned-cpu-buffers "
        "--fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size "
        "--delta-offload-bytes-across-pp-ranks --activation-offload-fraction "
        "--fine-grained-offloading-max-inflight-offloads --optimizer-cpu-offload --optimizer-offload-fraction "
        "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads "
        "--no-pin-cpu-params",
    "tpzoo splits transformer layers evenly over the pipeline stages":
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
        "--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --pipeline-model-parallel-layout",
    "tpzoo's attention backends are its own (--attention-backend)": "--flash-attention-version",
    "tpzoo has no sparse, linear or gated attention variants":
        "--softmax-type --qk-clip --qk-clip-alpha --qk-clip-threshold --attention-output-gate "
        "--experimental-attention-variant --dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk "
        "--dsa-indexer-topk-freq --dsa-indexer-skip-topk-offset --dsa-indexer-loss-coeff "
        "--dsa-indexer-use-sparse-loss --dsa-kernel-backend --dsa-indexer-rope-interleaved "
        "--no-dsa-indexer-rotate-activation --disable-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu "
        "--disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 "
        "--linear-conv-kernel-dim --linear-key-head-dim --linear-value-head-dim --linear-num-key-heads "
        "--linear-num-value-heads --window-attn-skip-freq --linear-attention-freq",
    "tpzoo keeps the residual stream in the model's dtype": "--fp32-residual-connection",
    "tpzoo's families fix where the residual is taken": "--apply-residual-connection-post-layernorm",
    "tpzoo's norms scale by their weight as stored (no 1 + weight)": "--apply-layernorm-1p",
    "tpzoo's gated MLP has no offset term": "--glu-linear-offset",
    "tpzoo does not clamp activations": "--activation-func-clamp-value",
    "tpzoo's rotary embedding rotates the two halves of every head, unscaled or scaled as Llama 3.x (--use-rope-scaling)":
        "--rotary-interleaved --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow "
        "--yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int "
        "--rotary-seq-len-interpolation-factor --no-rope-freq --rope-type",
    "tpzoo's query/key norm is the model's normalization (--qk-layernorm), decayed like every norm":
        "--qk-l2-norm --apply-wd-to-qk-layernorm",
    "tpzoo has no per-token loss normalization option": "--calculate-per-token-loss",
    "tpzoo has no multi-latent attention":
        "--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim "
        "--rotary-scaling-factor --mscale --mscale-all-dim --cache-mla-latents --mla-down-proj-fusion",
    "tpzoo initializes embeddings with --init-method-std": "--embedding-init-method-std",
    "tpzoo builds each rank's shard directly": "--init-model-with-meta-device",
    "tpzoo has no muP parametrization":
        "--use-mup --mup-width-mult --mup-base-hidden-size --mup-embedding-mult --mup-output-mult "
        "--mup-base-head-dim --mup-attn-scale-power",
    "tpzoo scales attention scores by 1/sqrt(head size) only": "--apply-query-key-layer-scaling",
    "tpzoo leaves torch's matmul precision settings as they are": "--disable-bf16-reduced-precision-matmul",
    "tpzoo's recompute keeps each layer's input whole on every tp rank": "--distribute-saved-activations",
    "tpzoo's selective recompute covers core attention only": "--recompute-modules",
    "tpzoo trains in float32, bf16 or fp16 (no fp8 or fp4)":
        "--fp8-format --fp8-recipe --fp8-quantizer-factory --fp8-margin --fp8-interval --fp8-amax-history-len "
        "--fp8-amax-compute-algo --no-fp8-wgrad --disable-fp8-wgrad --fp8-output-proj --first-last-layers-bf16 "
        "--num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 --use-kitchen-attention "
        "--kitchen-attention-backend --fp4-format --fp4-recipe --fp4-quantizer-factory "
        "--reuse-grad-buf-for-mxfp8-param-ag --keep-fp8-transpose-cache",
    "tpzoo captures no CUDA graphs":
        "--enable-cuda-graph --cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl "
        "--delay-offload-until-cuda-graph --optimizer-cuda-graph",
    "tpzoo has no inference engine or server (tpzoo.generate samples from a checkpoint)":
        "--inference-cuda-graph-scope --flash-decode --batch-invariant-mode --batch-invariant-backend "
        "--symmetric-ar-type --nccl-all-reduce-for-prefill --inference-fuse-tp-communication "
        "--inference-disable-triton-nvls-kernels --inference-grouped-gemm-backend "
        "--inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type --mrope-section "
        "--mlp-chunks-for-prefill --inference-rng-tracker --inference-batch-times-seqlen-threshold "
        "--max-tokens-to-oom --output-bert-embeddings --bert-embedder-type --cuda-graph-scope --cuda-graph-modules "
        "--use-legacy-static-engine --inference-max-requests --inference-max-seq-length "
        "--inference-dynamic-batching --inference-dynamic-batching-buffer-size-gb "
        "--inference-dynamic-batching-paused-buffer-size-gb --inference-dynamic-batching-mamba-memory-ratio "
        "--inference-dynamic-batching-block-size --inference-dynamic-batching-max-requests "
        "--inference-dynamic-batching-max-tokens --inference-dynamic-batching-num-cuda-graphs "
        "--inference-dynamic-batching-track-paused-request-events "
        "--inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs "
        "--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens "
        "--inference-dynamic-batching-unified-memory-level --enable-chunked-prefill --num-speculative-tokens "
        "--inference-dynamic-batching-prefix-caching --no-inference-dynamic-batching-prefix-caching "
        "--inference-dynamic-batching-prefix-caching-eviction-policy "
        "--inference-dynamic-batching-prefix-caching-coordinator-policy "
        "--inference-dynamic-batching-prefix-caching-routing-alpha "
        "--inference-dynamic-batching-prefix-caching-mamba-gb "
        "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
        "--inference-dynamic-batching-cuda-graph-sizing-distribution --inference-dynamic-batching-sampling-backend "
        "--use-same-sampling-seed-across-dp-ranks --inference-dynamic-batching-async-sched-mode "
        "--inference-dynamic-batching-logprobs-mode --inference-logging-step-interval "
        "--inference-text-gen-server-logging --no-inference-text-gen-server-logging --inference-wandb-logging "
        "--no-inference-wandb-logging --inference-coordinator-port --mamba-inference-conv-states-dtype "
        "--mamba-inference-ssm-states-dtype --inference-use-synchronous-zmq-collectives "
        "--no-inference-use-synchronous-zmq-collectives --inference-disable-ep-consensus "
        "--no-inference-disable-ep-consensus --inference-shards",
    "tpzoo's sequence-parallel embedding has no such clone":
        "--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding",
    "tpzoo records its configuration in each checkpoint's meta.json": "--config-logger-dir",
    "tpzoo computes the MLP over the whole sequence": "--mlp-chunks-for-training",
    "tpzoo's models are decoder-only or encoder-only stacks (no encoder-decoder)":
        "--encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length",
    "tpzoo has no relative position embeddings": "--relative-attention-num-buckets --relative-attention-max-distance",
    "deprecated in Megatron-LM: use --position-embedding-type rope": "--use-rotary-position-embeddings",
    "deprecated in Megatron-LM: use --position-embedding-type none": "--no-position-embedding",
    "tpzoo's activations are its families' GELU and SwiGLU (--swiglu)": "--openai-gelu --squared-relu --quick-geglu",
    "tpzoo exports no ONNX": "--onnx-safe",
    "tpzoo has no Muon or Lion optimizer":
        "--muon-momentum --muon-no-split-qkv --muon-nesterov --muon-scale-mode --muon-fp32-matmul-prec "
        "--muon-coefficient-type --muon-num-ns-steps --muon-tp-mode --muon-use-syrk --muon-extra-scale-factor "
        "--muon-scalar-optimizer --lion-beta1 --lion-beta2",
    "tpzoo has one parameter group (--weight-decay applies to every parameter)":
        "--no-weight-decay-cond-type --dump-param-to-param-group-map",
    "tpzoo has no profiler hooks (bench/ measures step times)":
        "--profile --profile-step-start --profile-step-end --use-pytorch-profiler --pytorch-profiler-collect-shapes "
        "--pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra --profile-ranks "
        "--record-memory-history --memory-snapshot-path --record-shapes --nvtx-ranges",
    "tpzoo refuses a global batch that micro-batch x dp does not divide": "--decrease-batch-size-if-needed",
    "tpzoo does not empty the CUDA cache between steps": "--empty-unused-memory-level",
    "tpzoo does not hash weights across dp replicas": "--check-weight-hash-across-dp-replicas-interval",
    "tpzoo runs no GPU performance sniff tests": "--gpu-sniff-test-interval",
    "tpzoo synchronizes with the device once per logged iteration": "--train-sync-interval",
    "tpzoo's --exit-signal-handler handles SIGTERM and SIGINT": "--exit-signal --exit-signal-handler-for-dataloader",
    "tpzoo's --exit-signal-handler already saves and exits on SIGTERM and SIGINT":
        "--exit-signal-handler-for-training",
    "tpzoo leaves Python's garbage collector as it is":
        "--manual-gc --manual-gc-interval --no-manual-gc-eval --disable-manual-gc-eval",
    "tpzoo skips only steps with a non-finite loss or gradient (--max-skipped-steps)": "--iterations-to-skip",
    "deprecated in Megatron-LM: use --micro-batch-size": "--batch-size",
    "tpzoo always checks the loss and gradient norm for NaN (--max-skipped-steps)":
        "--no-check-for-nan-in-loss-and-grad",
    "tpzoo does not check gradients against a running norm": "--check-for-large-grads",
    "tpzoo has no rerun engine": "--result-rejected-tracker-filename",
    "deprecated in Megatron-LM: use --recompute-activations": "--checkpoint-activations",
    "tpzoo reads its samples in one fixed order (resumable by consumed samples)": "--dataloader-type",
    "deprecated in Megatron-LM (mcore models are its default); tpzoo's models are its own": "--use-mcore-models",
    "tpzoo has no reinforcement-learning loop":
        "--perform-rl-step --rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --rl-generation-lag "
        "--rl-max-inflight-requests --rl-submission-granularity --rl-consumption-granularity "
        "--rl-durable-rollout-bank --rl-rollout-bank-dir --rl-rollout-bank-max-bytes --grpo-iterations "
        "--grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight "
        "--grpo-filter-groups-with-same-reward --langrl-env-config --rl-default-temperature --rl-default-top-p "
        "--rl-default-top-k --rl-offload-optimizer-during-inference --rl-kv-cache-management-mode "
        "--rl-persist-cuda-graphs --no-rl-persist-cuda-graphs --rl-partial-rollouts --no-rl-partial-rollouts "
        "--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction "
        "--rl-importance-sampling-truncation-coef --rl-use-sequence-packing --no-rl-use-sequence-packing "
        "--rl-sequence-packing-max-sequences-per-bin --rl-sequence-packing-algo --rl-training-cuda-graphs "
        "--no-rl-training-cuda-graphs --rl-inference-tensor-model-parallel-size "
        "--rl-inference-pipeline-model-parallel-size --rl-inference-expert-model-parallel-size "
        "--rl-inference-expert-tensor-model-parallel-size --rl-inference-model-unified-memory-level "
        "--rl-offload-inference-model-weights-when-idle --no-rl-offload-inference-model-weights-when-idle "
        "--refit-method --rl-verify-model-weights-swap --no-rl-verify-model-weights-swap --rl-skip-bos-token "
        "--no-rl-skip-bos-token --rl-profile --rl-profile-dir --rl-inference-parsers",
    "tpzoo initializes every dp replica identically": "--data-parallel-random-init",
    "tpzoo initializes weights from a normal distribution (--init-method-std)": "--init-method-xavier-uniform",
    "tpzoo's schedule on --load is the flags given, else the checkpoint's":
        "--override-opt_param-scheduler --override-opt-param-scheduler",
    "tpzoo's schedule on --load is the checkpoint's unless flags are given":
        "--use-checkpoint-opt_param-scheduler --use-checkpoint-opt-param-scheduler",
    "deprecated in Megatron-LM: use --lr-warmup-iters or --lr-warmup-samples": "--warmup",
    "tpzoo has one learning rate for all layers": "--decoupled-lr --decoupled-min-lr",
    "tpzoo trains every parameter": "--freeze-all-layers",
    "tpzoo saves and keeps full, synchronous checkpoints at --save-interval only":
        "--save-params-interval --save-activations-interval --save-wgrads-interval --save-dgrads-interval "
        "--save-retain-interval --non-persistent-save-interval --non-persistent-ckpt-type "
        "--non-persistent-global-ckpt-dir --non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo "
        "--async-save --async-strategy --use-persistent-ckpt-worker --async-ckpt-cpu-priority "
        "--async-ckpt-io-priority --async-ckpt-use-cpu-shm --replication --replication-jump --replication-factor",
    "tpzoo restores main parameters with the optimizer state": "--load-main-params-from-ckpt",
    "tpzoo fine-tunes from --load with --finetune (or tpzoo.finetune)": "--pretrained-checkpoint",
    "tpzoo loads a given iteration from --load DIR/iter_NNNNNNN": "--ckpt-step",
    "tpzoo reshards a checkpoint onto the mesh given (tp, pp, dp may change)": "--use-mp-args-from-checkpoint-args",
    "tpzoo's tokenizer on --load is the checkpoint's unless data flags are given":
        "--no-use-tokenizer-model-from-checkpoint-args --disable-use-tokenizer-model-from-checkpoint-args",
    "tpzoo saves one checkpoint format of its own (per-rank files with a manifest; docs/training.md)":
        "--ckpt-format --auto-detect-ckpt-format --ckpt-convert-format --ckpt-convert-save "
        "--ckpt-convert-update-legacy-dist-opt-format --no-ckpt-fully-parallel-save --ckpt-fully-parallel-load "
        "--ckpt-fully-parallel-load-exchange-algo --ckpt-fully-parallel-load-per-rank-objects "
        "--ckpt-fully-parallel-save-process-group --ckpt-fully-parallel-load-process-group "
        "--ckpt-assume-constant-structure --ckpt-pg-tensors-cache-path --ckpt-pg-tensors-cache-create "
        "--no-ckpt-load-validate-sharding-integrity --disable-ckpt-load-validate-sharding-integrity "
        "--no-strict-fsdp-dtensor-load --disable-strict-fsdp-dtensor-load --dist-ckpt-strictness "
        "--dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable "
        "--distrib-optim-fully-reshardable-mem-efficient --use-dist-ckpt --dist-ckpt-format --dist-ckpt-workers "
        "--ckpt-fully-parallel-save --ckpt-drop-redundant-extra-state",
    "tpzoo always copies the tokenizer into its checkpoints (a resume needs it)":
        "--no-save-tokenizer-assets --disable-save-tokenizer-assets",
    "tpzoo always checks checkpoints against their manifest's sizes and sha256": "--verify-integrity",
    "tpzoo resumes at the iteration a checkpoint holds": "--override-ckpt-iteration",
    "tpzoo's data-parallel reduce is its engine's own: float32 gradients in size buckets, reduced as backward ends":
        "--grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32 --no-align-grad-reduce "
        "--disable-align-grad-reduce --ddp-num-buckets --ddp-bucket-size "
        "--ddp-reduce-scatter-with-fp32-accumulation --ddp-param-name-patterns-for-fp32-local-accumulation "
        "--ddp-average-in-collective --overlap-param-gather-with-optimizer-step --no-align-param-gather "
        "--no-gradient-reduce-div-fusion",
    "tpzoo computes the cross entropy in float32": "--fp16-lm-cross-entropy",
    "tpzoo computes the output logits in the model's dtype": "--output-logit-dtype",
    "tpzoo picks the backend from the device (nccl on CUDA, gloo on CPU)": "--distributed-backend",
    "tpzoo initializes its process groups itself": "--lazy-mpu-init",
    "tpzoo's FSDP is torch's FSDP2 (--use-torch-fsdp2), not Megatron-FSDP":
        "--use-megatron-fsdp --megatron-fsdp-version --no-use-layer-wise-param-layout --fsdp-manual-registration "
        "--create-all-gather-group --data-parallel-sharding-strategy --outer-dp-sharding-strategy "
        "--fsdp-double-buffer --suggested-communication-unit-size --enable-full-sharding-in-hsdp "
        "--num-distributed-optimizer-instances --torch-fsdp2-no-reshard-after-forward "
        "--megatron-fsdp-main-params-dtype --megatron-fsdp-main-grads-dtype --megatron-fsdp-grad-comm-dtype "
        "--megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer "
        "--fsdp-db-use-persist-buf-on-alloc-fail",
    "tpzoo's collectives use torch.distributed's defaults (no NCCL tuning)":
        "--nccl-communicator-config-path --use-sharp --sharp-enabled-group --high-priority-stream-groups "
        "--flight-recorder-dump-path --flight-recorder-trace-buffer-size --no-flight-recorder-dump-on-timeout "
        "--disable-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace "
        "--no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active "
        "--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec "
        "--ddp-pad-buckets-for-high-nccl-busbw --use-nccl-ub --disable-symmetric-registration",
    "tpzoo's rank order on the mesh is fixed (docs/parallelism.md)": "--use-tp-pp-dp-mapping",
    "tpzoo creates its process groups with one backend": "--disable-gloo-process-groups",
    "tpzoo has one timeout (--distributed-timeout-minutes)": "--distributed-timeout-seconds-after-init",
    "tpzoo has no TorchScript fuser to turn off (--compile is opt-in)": "--disable-jit-fuser",
    "deprecated in Megatron-LM: use --tensor-model-parallel-size": "--model-parallel-size",
    "tpzoo's interleaving is --virtual-pipeline-model-parallel-size (chunks per rank)":
        "--num-layers-per-virtual-pipeline-stage --num-virtual-stages-per-pipeline-rank",
    "tpzoo runs real process groups (gloo on CPU)": "--fake-process-group",
    "tpzoo evaluates --eval-iters training-sized batches of one validation set every --eval-interval":
        "--start-eval-at-iter --eval-global-batch-size --eval-micro-batch-size --skip-train --test-mode "
        "--full-validation --multiple-validation-sets --validation-set-names",
    "tpzoo builds every dataset of --data-path itself, memory-mapped, for the whole run":
        "--phase-transition-iterations --data-args-path --per-split-data-args-path --per-dataset-sequences-path "
        "--dataloader-fast-cache-load --dataloader-defer-npy-index-mmap --no-mmap-bin-files --sample-rate "
        "--num-dataset-builder-threads --mid-level-dataset-surplus",
    "tpzoo's BERT short-sequence rate is fixed": "--short-seq-prob",
    "tpzoo trains on whole sequences across document boundaries (positions, attention, loss)":
        "--reset-position-ids --reset-attention-mask --dataloader-inter-document-masking --eod-mask-loss",
    "tpzoo has no such option for its samples": "--no-create-attention-mask-in-dataloader",
    "tpzoo reads and writes local paths only (no multi-storage client)":
        "--object-storage-cache-path --enable-msc --disable-msc",
    "tpzoo pads BERT samples with the tokenizer's [PAD] only": "--allow-ambiguous-pad-tokens",
    "tpzoo has no fill-in-the-middle data":
        "--fim-data --fim-rate --fim-spm-rate --fim-split-sample --fim-fragment-rate --fim-no-prefix "
        "--fim-prefix-token --fim-middle-token --fim-suffix-token --fim-pad-token --fim-eod-token",
    "tpzoo pads the vocabulary by --make-vocab-size-divisible-by x tp":
        "--padded-vocab-size --no-pad-vocab-size --disable-pad-vocab-size",
    "tpzoo has no T5 span-masking tokens": "--vocab-extra-ids",
    "tpzoo's tokenizers are used as their files define them (no tiktoken, chat templates, extra options)":
        "--tokenizer-metadata --tokenizer-special-tokens --tiktoken-pattern --tiktoken-num-special-tokens "
        "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast "
        "--tokenizer-hf-no-include-special-tokens --trust-remote-code --chat-template --use-gigatoken",
    "tpzoo has no in-process restart or fault-tolerance service (a stopped run resumes with --load)":
        "--adlr-autoresume --adlr-autoresume-interval --inprocess-restart --inprocess-max-iterations "
        "--inprocess-monitor-thread-interval --inprocess-monitor-process-interval "
        "--inprocess-progress-watchdog-interval --inprocess-heartbeat-interval --inprocess-soft-timeout "
        "--inprocess-hard-timeout --inprocess-heartbeat-timeout --inprocess-barrier-timeout "
        "--inprocess-completion-timeout --inprocess-last-call-wait --inprocess-termination-grace-time "
        "--inprocess-granularity --inprocess-active-world-size --inprocess-empty-cuda-cache --enable-ft-package "
        "--calc-ft-timeouts --ft-num-warmup-iters --error-injection-rate --error-injection-type --rerun-mode "
        "--check-for-spiky-loss --fault-injector-ranks --fault-injector-num-ranks --fault-injector-fault-types "
        "--fault-injector-fault-probabilities --fault-injector-fault-delay --fault-injector-delay-start-iteration "
        "--fault-injector-mtti-seconds --fault-injector-offset-seconds --fault-injector-seed",
    "tpzoo has no retrieval bi-encoder models":
        "--ict-head-size --biencoder-projection-dim --biencoder-shared-query-context-model --ict-load --bert-load "
        "--titles-data-path --query-in-block-prob --use-one-sent-docs --evidence-data-path "
        "--retriever-report-topk-accuracies --retriever-score-scaling --block-data-path --embedding-path "
        "--indexer-batch-size --indexer-log-interval",
    "tpzoo has no vision models":
        "--num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction --data-per-class-fraction "
        "--no-data-sharding --head-lr-mult --vision-pretraining --vision-pretraining-type --vision-backbone-type "
        "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
        "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer "
        "--dino-norm-last-layer --dino-warmup-teacher-temp --dino-teacher-temp --dino-warmup-teacher-temp-epochs",
    "tpzoo's layers are all alike (no per-layer configurations)":
        "--heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json",
    "tpzoo does not log this (its metrics: docs/training.md)":
        "--log-progress --log-memory-interval --log-device-memory-used --log-max-attention-logit --logging-level "
        "--log-energy",
    "tpzoo's timers use no barriers to turn off": "--no-barrier-with-level-1-timing",
    "tpzoo logs to the console, metrics.jsonl, TensorBoard and W&B only":
        "--otel-enabled --otel-service-name --otel-span-groups --no-one-logger --one-logger-project "
        "--one-logger-run-name --one-logger-async --app-tag-run-name --app-tag-run-version",
    "tpzoo has no knowledge distillation":
        "--logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k --logits-save-dir --logits-save-dtype "
        "--logits-load-dir --logits-load-decode-threads --logits-load-prefetch-factor "
        "--logits-load-msc-prefetch-depth --logits-load-kd-loss-alpha --logits-load-ignore-errors",
    "tpzoo has no straggler detection":
        "--log-straggler --straggler-ctrlr-port --straggler-minmax-count --disable-straggler-on-startup",
    "tpzoo has no workload inspector server": "--run-workload-inspector-server",
    "tpzoo has no experimental features": "--enable-experimental",
    "tpzoo reads its configuration files with --config (TOML or YAML of its own sections, docs/config.md)":
        "--yaml-cfg",
    "tpzoo keeps fp32 main weights and Adam state":
        "--use-precision-aware-optimizer --main-grads-dtype --main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype",
    "tpzoo has no supervised fine-tuning datasets (tpzoo.finetune has its own tasks)":
        "--sft --sft-tokenizer-prompt-format",
}
# Megatron-LM flag -> why tpzoo does not support it (one clause); entries may be added one a line below
REFUSED: dict[str, str] = {
    **{flag: why for why, flags in _BY_REASON.items() for flag in flags.split()},
}


class _Refuse(argparse.Action):
    """Takes any number of values, then ends parsing with the flag's one-line refusal."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        parser.error(f"{option_string} is a Megatron-LM flag tpzoo does not support: {REFUSED[self.dest_flag]}")

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS, **kwargs)
        self.dest_flag = option_strings[0]


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    """Define every REFUSED flag the parser does not already have (call it after every other group,
    so a flag tpzoo implements is never shadowed by its refusal)."""
    group = parser.add_argument_group("Megatron-LM flags tpzoo refuses (docs/megatron.md)")
    for flag in REFUSED:
        if flag not in parser._option_string_actions:
            group.add_argument(flag, action=_Refuse, help=argparse.SUPPRESS)
