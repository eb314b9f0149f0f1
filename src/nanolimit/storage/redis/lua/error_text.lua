local function error_text(e)
  if type(e) == 'table' then e = e.err end
  return 'E ' .. tostring(e)
end
