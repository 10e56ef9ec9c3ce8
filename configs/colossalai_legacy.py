# A Colossal-AI (legacy API) config as such configs are written: it loads unchanged.
# colossalai need not be installed; its imports get stand-ins while the file runs.
from colossalai.amp import AMP_TYPE

# The script's own values (UPPER_CASE): eng.config.constants["BATCH_SIZE"].
BATCH_SIZE = 128
NUM_EPOCHS = 200

gradient_accumulation = 4  # -> gradient_accumulation_steps
clip_grad_norm = 1.0  # -> gradient_clipping
fp16 = dict(mode=AMP_TYPE.TORCH)  # -> fp16 with torch's grad-scaler settings
parallel = dict(pipeline=1, tensor=dict(size=1, mode=None))  # plain data parallelism: accepted

# Legacy keys Microstep does not use: kept in config.colossalai_extras, with a warning.
logging = dict(root_path="./logs")
num_epochs = 2
