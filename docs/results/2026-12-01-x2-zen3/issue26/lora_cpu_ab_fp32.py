import runpy, sys
import engine.lora as lora
init = lora.LoraWeights.__init__
def fp32(self, *a, **k):
    k.pop("compact", None)
    init(self, *a[:5], compact=False, **k)
lora.LoraWeights.__init__ = fp32
sys.argv = ["ab", *sys.argv[1:]]
runpy.run_path(__file__.replace("_fp32", ""), run_name="__main__")  # lora_cpu_ab.py beside it
