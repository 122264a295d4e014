"""BLS (Business Logic Scripting): each row of each request is sent on to `plain` (no batching: one [1, 16]
row per call) and the answers are passed back. An error from `plain` is this request's error."""
import sys

sys.dont_write_bytecode = True

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

CALLEE = "plain"


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            rows, error = [], None
            for row in x:
                # trace=: the call is traced as this request's child, so the controller sees that bls calls plain
                answer = pb_utils.InferenceRequest(model_name=CALLEE, requested_output_names=["OUTPUT"],
                                                   inputs=[pb_utils.Tensor("INPUT", row[None, :])],
                                                   trace=request.trace()).exec()
                if answer.has_error():
                    error = answer.error().message()
                    break
                rows.append(pb_utils.get_output_tensor_by_name(answer, "OUTPUT").as_numpy()[0])
            if error is not None:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{CALLEE}: {error}")))
            else:
                out = np.stack(rows).astype(np.float32)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
        return responses
