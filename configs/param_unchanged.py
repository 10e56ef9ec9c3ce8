# Colossal-AI style config: lower-case globals are engine settings,
# UPPER_CASE globals are constants the training script reads from eng.config.constants.
NUM_ITERATIONS = 8
IN_FEATURES = 16

train_micro_batch_size_per_gpu = 2
gradient_accumulation = 4

optimizer = dict(type="SGD", params=dict(lr=0.1))

seed = 42
