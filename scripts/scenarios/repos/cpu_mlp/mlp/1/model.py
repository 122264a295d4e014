"""A user's torch MLP on the CPU (512 -> 2048 -> 2048 -> 2048 -> 10), written as users write one: the requests'
inputs concatenated into one batch, torch's default threads, nothing tuned for the controller. See config.pbtxt."""
import numpy as np
import torch
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 10)).eval()

    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        sizes = [x.shape[0] for x in xs]
        with torch.inference_mode():
            y = self.net(torch.from_numpy(np.concatenate(xs))).numpy()
        out, i = [], 0
        for n in sizes:
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y[i:i + n])]))
            i += n
        return out
