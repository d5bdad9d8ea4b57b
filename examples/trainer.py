"""transformers.Trainer on DeepSpeed ZeRO-3 with deepcompile_remat: a whole run (a tiny Llama
on random tokens; put your model and data in their place).

    torchrun --nproc_per_node 2 examples/trainer.py --deepspeed configs/trainer_zero3_remat.json \
        --bf16 --output_dir out/trainer --max_steps 10             # GPUs
    torchrun --nproc_per_node 2 examples/trainer.py --deepspeed configs/trainer_zero3_remat.json \
        --bf16 --output_dir out/trainer --max_steps 10 --use_cpu   # CPU processes (gloo)

Any TrainingArguments flag works (--max_steps, --torch_compile_backend aot_eager, ...). Then,
in any process: transformers.AutoModelForCausalLM.from_pretrained("out/trainer").
"""
import logging

import deepspeed
import torch
import transformers

import deepcompile_remat.deepspeed as dcr_ds

logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
logging.getLogger("deepcompile_remat").setLevel(logging.INFO)  # the takeover's line (rank 0)
dcr_ds.install()  # Trainer's deepspeed.initialize now honours the "deepcompile_remat" block

parser = transformers.HfArgumentParser(transformers.TrainingArguments)
(args,) = parser.parse_args_into_dataclasses()

# DeepSpeed's communication up before the model: Accelerate starts it on GPUs, not under
# --use_cpu, and zero.Init would then size batches for one rank.
deepspeed.init_distributed()
# Built after TrainingArguments(deepspeed=...), so under deepspeed.zero.Init: already sharded.
config = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, max_position_embeddings=64)
model = transformers.AutoModelForCausalLM.from_config(config)
tokens = torch.randint(0, config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": t, "labels": t} for t in tokens]

trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print(f"rank {args.process_index}: {trainer.model_wrapped.dcr_takeover}")  # Takeover(...)
trainer.save_model(args.output_dir)  # the full weights, gathered: from_pretrained reads them
